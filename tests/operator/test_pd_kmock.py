"""kopf on the KMock emulator with spec.prefill: the prefill groups and the decode groups are created, reported,
scaled, rolled and recreated each on their own; the router runs in P/D mode; an invalid prefill is a condition
naming the field; removing spec.prefill removes the prefill groups."""

from __future__ import annotations

import pytest
from operator_harness import NS, eventually, labels
from test_autoscaling_kmock import has
from test_operator_kmock import _has, _reason
from test_router_operator import DEPLOYMENTS, router_apis  # noqa: F401 (a fixture)

from pagoda_operator import builders as b
from pagoda_operator.spec import parse_spec

pytestmark = [pytest.mark.operator, pytest.mark.usefixtures("router_apis")]  # the router's kinds served

PD_SPEC = {"image": "pagoda-runtime:test", "resources": {"requests": {"cpu": "1"}}, "replicas": 1,
           "router": {"enabled": True, "policy": "prefix"}, "prefill": {"replicas": 1}}


# generous: the operator's passes share two busy cores with other tests
WAIT = 60.0


async def wait(check, what: str = ""):
    return await eventually(check, WAIT, what)


def args_of(obj: dict) -> list[str]:
    return obj["spec"]["template"]["spec"]["containers"][0]["args"]


async def router_deployment(cluster) -> dict:
    items = (await cluster._json("GET", DEPLOYMENTS))["items"]
    return next(d for d in items if d["metadata"]["name"] == "pd-router")


async def uids(cluster) -> dict[str, str]:
    return {name: pod["metadata"]["uid"] for name, pod in (await cluster.pods("pd")).items()}


async def services_named(cluster, names: set[str]) -> dict | None:
    services = await cluster.services()
    return services if names <= set(services) else None


async def prefill_ready(cluster, ready: str) -> dict | None:
    await cluster.reconcile_pods()
    status = await cluster.status("pd")
    return status if (status.get("prefill") or {}).get("ready") == ready and status.get("phase") == "Ready" else None


async def test_prefill_makes_both_roles_and_the_router_runs_in_pd_mode(cluster, operator):
    await cluster.create("pd", PD_SPEC)
    sts = await wait(lambda: _has(cluster.statefulsets("pd"), 2), what="a decode and a prefill group")
    assert set(sts) == {"pd-g0-head", "pd-p0-head"}
    assert labels(sts["pd-p0-head"]["spec"]["template"])["llm-d.ai/role"] == "prefill"
    assert '"kv_role": "kv_producer"' in args_of(sts["pd-p0-head"])[-1]
    assert '"kv_role": "kv_consumer"' in args_of(sts["pd-g0-head"])[-1]
    # the three by name: the router's own Service (pd-router) may come in the same pass or the next
    services = await wait(lambda: services_named(cluster, {"pd", "pd-headless", "pd-prefill"}),
                          what="Services pd, pd-headless, pd-prefill")
    assert services["pd-prefill"]["spec"]["selector"]["pagoda.dev/pd-role"] == "prefill"
    assert services["pd"]["spec"]["selector"]["pagoda.dev/pd-role"] == "decode"

    status = await wait(lambda: prefill_ready(cluster, "1/1"), what="both roles Ready")
    assert status["readyReplicas"] == 1 and status["prefill"]["readyReplicas"] == 1
    assert sorted(await cluster.pods("pd")) == ["pd-g0-head-0", "pd-p0-head-0"]
    await wait(has(cluster, DEPLOYMENTS, {"pd-router"}), what="the router")
    args = args_of(await router_deployment(cluster))
    assert args[args.index("--k8s-service") + 1] == "pd"
    assert args[args.index("--prefill-k8s-service") + 1] == "pd-prefill"

    # a prefill pod not Ready: the decode groups still serve (Available), the status says prefill is short
    await cluster.set_pod("pd-p0-head-0", ready=False)

    async def prefill_short():
        status = await cluster.status("pd")
        return status if status["prefill"]["ready"] == "0/1" else None
    status = await wait(prefill_short, what="prefill 0/1")
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Available"]["status"] == "True"
    assert conditions["Progressing"]["message"].startswith("prefill")


async def test_each_role_scales_rolls_and_restarts_on_its_own(cluster, operator):
    await cluster.create("pd", PD_SPEC)
    await wait(lambda: _has(cluster.statefulsets("pd"), 2))
    await wait(lambda: prefill_ready(cluster, "1/1"), what="Ready")
    before = await uids(cluster)

    # prefill.replicas: one prefill group more; no pod replaced
    await cluster.update_spec("pd", {"prefill": {"replicas": 2}})
    await wait(lambda: prefill_ready(cluster, "2/2"), what="two prefill groups")
    now = await uids(cluster)
    assert {k: now[k] for k in before} == before and "pd-p1-head-0" in now

    # prefill.resources: the prefill pods are replaced, the decode pod stays
    await cluster.update_spec("pd", {"prefill": {"replicas": 2, "resources": {"requests": {"cpu": "2"}}}})

    async def prefill_replaced():
        await cluster.reconcile_pods()
        pods = await uids(cluster)
        return pods if len(pods) == 3 and all(pods[p] != now[p] for p in ("pd-p0-head-0", "pd-p1-head-0")) else None
    replaced = await wait(prefill_replaced, what="the prefill pods replaced")
    assert replaced["pd-g0-head-0"] == before["pd-g0-head-0"]
    await wait(lambda: prefill_ready(cluster, "2/2"), what="Ready again")

    # a prefill pod restarts: its group is recreated (its own epoch), nothing else
    steady = await uids(cluster)
    await cluster.set_pod("pd-p1-head-0", ready=False, restarts=1)

    async def recreated():
        sts = await cluster.statefulsets("pd")
        return sts if sts["pd-p1-head"]["metadata"]["annotations"].get("pagoda.dev/epoch") == "1" else None
    sts = await wait(recreated, what="prefill group 1 recreated")
    assert sts["pd-g0-head"]["metadata"]["annotations"].get("pagoda.dev/epoch", "0") == "0"
    assert sts["pd-p0-head"]["metadata"]["annotations"].get("pagoda.dev/epoch", "0") == "0"
    after = await wait(lambda: prefill_ready(cluster, "2/2"), what="Ready after the recreation")
    pods = await uids(cluster)
    assert pods["pd-g0-head-0"] == steady["pd-g0-head-0"] and pods["pd-p0-head-0"] == steady["pd-p0-head-0"]
    assert "prefill group 1" in " ".join(e["message"] for e in await cluster.events("pd")
                                         if e["reason"] == "RecreatingGroup")
    assert after["readyReplicas"] == 1

    # the decode groups scale on their own too
    await cluster.update_spec("pd", {"replicas": 2})
    await cluster.converge_groups("pd", 2, timeout=WAIT)
    pods = await uids(cluster)
    assert pods["pd-p0-head-0"] == steady["pd-p0-head-0"]


async def test_invalid_prefill_is_a_condition_naming_the_field(cluster, operator):
    await cluster.create("bad", {**PD_SPEC, "prefill": {"replicas": 0}})
    cond = await wait(lambda: _reason(cluster, "bad", "Degraded", "InvalidSpec"), what="InvalidSpec")
    assert "prefill.replicas" in cond["message"]
    assert await cluster.statefulsets("bad") == {}

    # on a running deployment: the last valid spec stays in force, SpecValid names the field
    await cluster.create("pd", PD_SPEC)
    await wait(lambda: prefill_ready(cluster, "1/1"), what="Ready")
    await cluster.update_spec("pd", {"prefill": {"replicas": 1, "parallelism": {"data": 2}}})

    async def refused():
        cond = await cluster.condition("pd", "SpecValid")
        return cond if cond.get("status") == "False" else None
    cond = await wait(refused, what="SpecValid False")
    assert "prefill.parallelism.data" in cond["message"]
    assert set(await cluster.statefulsets("pd")) == {"pd-g0-head", "pd-p0-head"}


async def test_removing_prefill_removes_the_prefill_groups(cluster, operator):
    await cluster.create("pd", PD_SPEC)
    await wait(lambda: prefill_ready(cluster, "1/1"), what="Ready")
    await cluster.update_spec("pd", {"prefill": None})
    await wait(lambda: _has(cluster.statefulsets("pd"), 1), what="the prefill group gone")

    async def plain():
        await cluster.reconcile_pods()
        status = await cluster.status("pd")
        services = await cluster.services()
        return status if ("prefill" not in status or status["prefill"] is None) and "pd-prefill" not in services \
            and status.get("phase") == "Ready" else None
    await wait(plain, what="status.prefill and Service pd-prefill gone, the decode group back to plain")
    sts = await cluster.statefulsets("pd")
    assert "--kv-transfer-config" not in args_of(sts["pd-g0-head"])
    # Service pd applied as without spec.prefill (server-side apply then drops the role from its selector; KMock
    # merges, so compare what was applied)
    plain_body = {"metadata": {"name": "pd", "namespace": NS, "uid": "uid-pd"},
                  "spec": {k: v for k, v in PD_SPEC.items() if k != "prefill"}}
    wanted = b.build_head_service(parse_spec(plain_body, default_image="i"), plain_body)
    applied = (await cluster.services())["pd"]["metadata"]["annotations"][b.ANNOTATION_APPLIED_HASH]
    assert applied == wanted["metadata"]["annotations"][b.ANNOTATION_APPLIED_HASH]

    async def router_plain():
        args = args_of(await router_deployment(cluster))
        return args if "--prefill-k8s-service" not in args else None
    await wait(router_plain, what="the router out of P/D mode")
