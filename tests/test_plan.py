"""One request plan sizes every cache (tandem.runtime.plan): the rows each loop reserves, by hand."""
from __future__ import annotations

import pytest

from tandem.config import SpecConfig
from tandem.runtime.plan import RequestPlan, plan_request

SPEC = SpecConfig(k=4, nodes=10, width=2, depth=3)  # tree region of a serial tree: 3*2 + 2*2 = 10 rows


@pytest.mark.parametrize("method, hybrid, expected", [
    # target = prompt 5 + new 20 + slack + 1; draft = target + nodes 10 + k 4 + tree 10
    ("ar", False, RequestPlan(27, 51, 10)),  # slack 1
    ("chain", False, RequestPlan(31, 55, 10)),  # slack k + 1
    ("tree", False, RequestPlan(45, 69, 10)),  # slack N + 1 + w * (d + 1) = 19
    ("tree", True, RequestPlan(37, 61, 10)),  # hybrid: slack N + 1
    # async: tree region max(2N, N + 16w) + w = 44; target 5 + 20 + N + 2; draft target + 44 + 1
    ("async", False, RequestPlan(37, 82, 44)),
    # the engine's per-request draft cache: prompt + new + N + k + tree + 2
    ("engine", False, RequestPlan(27, 51, 10)),
])
def test_plan_rows_per_method(method, hybrid, expected):
    assert plan_request(method, 5, 20, SPEC, hybrid=hybrid) == expected

