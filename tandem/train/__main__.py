"""`python -m tandem.train --out DIR [--tiny]`: train, export and evaluate a draft/target pair."""
import sys

from tandem.train.recipe import main

sys.exit(main())
