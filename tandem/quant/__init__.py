"""Fewer bytes per exact pass: the lossless W12 weight format and the certified INT8 LM head."""
