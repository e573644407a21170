"""spec.prefill (prefill/decode disaggregation): what the P/D roles add to the pods. Pure functions.

With spec.prefill the main groups are the decode role (kv_consumer) and a second set of groups, built from
spec.prefill_view, the prefill role (kv_producer); the router sends each prompt to a prefill pod, then its
decode to a decode pod, which READs the prompt's KV cache from the prefill pod over NIXL (vLLM's NixlConnector).

Prefill group i is StatefulSet X-p<i>-head (and X-p<i>-worker): the same length as the main groups' X-g<i>-...,
so the name limits hold. Its pods carry the group labels of any group plus the role label; its StatefulSets
select on that label too, while the main groups keep their selectors (immutable) and gain only the label.
Without spec.prefill nothing here adds anything: every manifest is what it was before."""

from __future__ import annotations

import json
from typing import Any

from .spec import KV_TRANSFER_FLAG, DeploymentSpec

# The P/D role of a pod: prefill | decode. llm-d's own label too, so that llm-d's scheduler (its by-label
# filters) and dashboards see the roles.
LABEL_PD_ROLE = "pagoda.dev/pd-role"
LABEL_LLM_D_ROLE = "llm-d.ai/role"
PREFILL = "prefill"
DECODE = "decode"
KV_ROLES = {PREFILL: "kv_producer", DECODE: "kv_consumer"}
# vLLM's NIXL side channel: each pod answers handshakes on its own IP and this port (the runtime's default)
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
SIDE_CHANNEL_PORT = 5600
SIDE_CHANNEL_PORT_NAME = "nixl"


def is_prefill(spec: DeploymentSpec) -> bool:
    return spec.pd_role == PREFILL


def group_letter(spec: DeploymentSpec) -> str:
    """The letter before a group's index in its StatefulSets' names: X-g<i>-head, or X-p<i>-head for prefill."""
    return "p" if is_prefill(spec) else "g"


def role_labels(spec: DeploymentSpec) -> dict[str, str]:
    """The P/D role labels of a pod (none without spec.prefill)."""
    if spec.pd_role is None:
        return {}
    return {LABEL_PD_ROLE: spec.pd_role, LABEL_LLM_D_ROLE: spec.pd_role}


def role_selector(spec: DeploymentSpec) -> dict[str, str]:
    """What a prefill group's StatefulSets select on beside the group labels (the main groups' selectors stay as
    they were: a StatefulSet's selector cannot change)."""
    return {LABEL_PD_ROLE: PREFILL} if is_prefill(spec) else {}


def head_role_selector(spec: DeploymentSpec) -> dict[str, str]:
    """What Service X (decode heads) and Service X-prefill (prefill heads) select on beside role=head."""
    return {LABEL_PD_ROLE: spec.pd_role} if spec.pd_role else {}


def role_of(obj: dict[str, Any]) -> str | None:
    """The P/D role label of a listed StatefulSet or pod (None: a main group's from before spec.prefill)."""
    return ((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_PD_ROLE)


def kv_transfer_args(spec: DeploymentSpec) -> list[str]:
    if spec.pd_role is None:
        return []
    config = {"kv_connector": "NixlConnector", "kv_role": KV_ROLES[spec.pd_role]}
    return [KV_TRANSFER_FLAG, json.dumps(config)]


def side_channel_env(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """The pod's own IP (downward API) and the fixed port: what a prefill pod puts in its kv_transfer_params
    (remote_host, remote_port) for the decode pod to reach."""
    if spec.pd_role is None:
        return []
    return [{"name": SIDE_CHANNEL_HOST_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": SIDE_CHANNEL_PORT_ENV, "value": str(SIDE_CHANNEL_PORT)}]


def side_channel_ports(spec: DeploymentSpec) -> list[dict[str, Any]]:
    if spec.pd_role is None:
        return []
    return [{"name": SIDE_CHANNEL_PORT_NAME, "containerPort": SIDE_CHANNEL_PORT, "protocol": "TCP"}]


def prefill_service_name(spec: DeploymentSpec) -> str:
    """Service X-prefill: the prefill heads, from whose EndpointSlices the router discovers them."""
    return f"{spec.name}-prefill"


def group_word(spec: DeploymentSpec) -> str:
    """How Events name a group of this role."""
    return "prefill group" if is_prefill(spec) else "group"


def replicas_field(spec: DeploymentSpec) -> str:
    return "prefill.replicas" if is_prefill(spec) else "replicas"

