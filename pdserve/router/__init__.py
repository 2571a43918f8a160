"""pdserve.router: pure routing and QoS policy.

Decides, from plain values, whether to admit a request (``admit``) and where
to prefill it (``decide``). Policies are validated YAML (``parse_policy``,
``load_policy_file``; the autoscale policy's ``parse_autoscale``, ``load_autoscale_file``);
the only state is the ``CostModel`` the decode worker feeds with measured timings. Nothing here does I/O except ``load_*_file``
and the ``pdserve policy`` CLI in ``router/cli.py``.
"""

from pdserve.router.costs import ArrivalRate, CostEstimates, CostModel
from pdserve.router.decide import decide
from pdserve.router.loader import (
    PolicyError,
    PolicyIssue,
    load_any_file,
    load_autoscale_file,
    load_policy_file,
    parse_any,
    parse_autoscale,
    parse_policy,
)
from pdserve.router.policy import DEFAULT_POLICY, RouterPolicy
from pdserve.router.qos import Admission, TokenLimit, TokenShare, admit, admit_tenant_tokens, tenant_token_limit
from pdserve.router.values import ClusterSnapshot, Decision, RequestFeatures

__all__ = [
    "Admission",
    "ArrivalRate",
    "ClusterSnapshot",
    "CostEstimates",
    "CostModel",
    "DEFAULT_POLICY",
    "Decision",
    "PolicyError",
    "PolicyIssue",
    "RequestFeatures",
    "RouterPolicy",
    "TokenLimit",
    "TokenShare",
    "admit",
    "admit_tenant_tokens",
    "decide",
    "load_any_file",
    "load_autoscale_file",
    "load_policy_file",
    "parse_any",
    "parse_autoscale",
    "parse_policy",
    "tenant_token_limit",
]
