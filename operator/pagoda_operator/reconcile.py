"""One level-triggered pass over an LLMDeployment: observe the children, act, write the status.

Every trigger (the resource changing, a pod changing, the periodic resync) runs the same pass,
so a missed event or an operator restart only delays convergence; it never changes the outcome.

Rollout strategy: replace, one group at a time. A stale group that is not Ready is replaced at
once (it serves nothing); a Ready stale group is replaced only while every other group is Ready.
We replace instead of surging because a group is a whole set of GPU nodes (TP 8 x PP 2 = 16 GPUs):
surging would need that much spare capacity, which GPU clusters rarely have, and a half-scheduled
surge group would block the rollout forever."""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import kopf
import kubernetes

from . import adapters as ad
from . import builders as b
from . import disaggregation as pd
from . import model_cache as mc
from .autoscaling import KEDA_API, AutoscalerPlan, plan_autoscaler, with_autoscaler_status
from .kube import Cluster
from .metrics import OperatorMetrics
from .records import GroupRecord, backoff_after
from .router import INFERENCE_POOL_API, ROUTER_KINDS, build_inference_pool, build_router, router_name
from .scheduling import VOLCANO_API
from .settings import OperatorSettings
from .spec import DeploymentSpec, InvalidSpec, parse_spec, prefill_view, with_replicas
from .status import (
    GroupObservation,
    build_status,
    invalid_status,
    pod_revision_of,
    rejected_status,
    status_changed,
    with_prefill_status,
    with_spec_unrealised,
)
from .times import from_iso, seconds_since, to_iso, utcnow

log = logging.getLogger("pagoda_operator")
EVENT_REPEAT_SECONDS = 600
# A group whose torch.distributed world broke cannot finish requests: its pods need no drain.
BROKEN_GROUP_GRACE_SECONDS = 5


@dataclass
class Listed:
    """The StatefulSets listed at the start of a pass. `unwritten` keeps the copies this pass has not
    written over, so applies compare against them instead of reading each object again."""
    statefulsets: list[dict[str, Any]]
    unwritten: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.unwritten = {s["metadata"]["name"]: s for s in self.statefulsets}


@dataclass
class Reconciler:
    cluster: Cluster
    settings: OperatorSettings
    clock: Callable[[], datetime.datetime] = utcnow
    _locks: dict[tuple[str, str], threading.Lock] = field(default_factory=dict)
    _locks_guard: threading.Lock = field(default_factory=threading.Lock)
    _queued: set[tuple[str, str]] = field(default_factory=set)
    passes: int = 0  # passes run by this process (a standby replica runs none)
    _recent_events: dict[tuple[str, ...], datetime.datetime] = field(default_factory=dict)
    # Pods whose DELETED event arrived: a hint that covers pods deleted before any pass recorded them
    # as members. Kept until a pass completes; the durable member list covers everything else.
    _deleted: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=dict)
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    # API discovery results: (group, version, plural) -> (served, when, monotonic seconds)
    _discovered: dict[tuple[str, str, str], tuple[bool, float]] = field(default_factory=dict)
    # a group's head pod and the runtime's API key -> its adapter endpoints (None before the pod has an address)
    runtime_client: Callable[[dict[str, Any], str | None], ad.RuntimeAdapters | None] = ad.client_for_pod

    def lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    # ----- events -----

    def _event(self, body: dict[str, Any], event_type: str, reason: str, message: str) -> None:
        """Tell the user on the LLMDeployment (kubectl describe); an Event that cannot be written
        must not stop the pass. The same Event is not repeated within EVENT_REPEAT_SECONDS (a pass
        that keeps meeting the same situation says it once, as kubectl's event aggregation would)."""
        meta = body.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "", reason, message)
        now = self.clock()
        with self._locks_guard:
            last = self._recent_events.get(key)
            if last is not None and (now - last).total_seconds() < EVENT_REPEAT_SECONDS:
                return
            self._recent_events = {k: t for k, t in self._recent_events.items()
                                   if (now - t).total_seconds() < EVENT_REPEAT_SECONDS}
            self._recent_events[key] = now
        try:
            self.cluster.record_event(body, event_type, reason, message, to_iso(self.clock()))
        except kubernetes.client.ApiException as e:
            log.warning("could not record event %s on %s: %s %s", reason,
                        (body.get("metadata") or {}).get("name"), e.status, e.reason)

    # ----- backoff -----

    def recreate_delay(self, recreations: int) -> float:
        """Seconds to wait after the last recreation before the next one (0 for the first)."""
        if recreations <= 0:
            return 0.0
        base, cap = self.settings.recreate_backoff_seconds, self.settings.recreate_backoff_max_seconds
        return min(cap, base * 2 ** (recreations - 1))

    def recreate_wait(self, record: GroupRecord) -> float:
        elapsed = seconds_since(record.recreated_at, self.clock())
        if elapsed is None:
            return 0.0
        return max(0.0, self.recreate_delay(record.recreations) - elapsed)

    # ----- the pass -----

    def reconcile(self, namespace: str, name: str, deleted_pod: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Run a pass for one LLMDeployment, coalescing bursts: while a pass runs, later triggers
        leave one queued pass behind them and return at once (None), instead of piling up threads."""
        key = (namespace, name)
        with self._locks_guard:
            if deleted_pod is not None:
                self._deleted.setdefault(key, []).append(deleted_pod)
            if key in self._queued:
                return None  # the queued pass has not started yet: it will see this change too
            self._queued.add(key)
        with self.lock(namespace, name):
            with self._locks_guard:
                self._queued.discard(key)
                deleted = self._deleted.pop(key, [])
                self.passes += 1
            body = None
            started = time.monotonic()
            try:
                # Events may carry an older copy; decide on the latest spec and status.
                body = self.cluster.get_llmdeployment(namespace, name)
                if body is None:
                    self.metrics.forget(namespace, name)
                    return {}  # deleted meanwhile: garbage collection takes the children
                self.metrics.passed(namespace, name)
                return self._reconcile(body, deleted)
            except kopf.PermanentError:
                raise  # an invalid spec: counted by the pass
            except kubernetes.client.ApiException as e:
                self.metrics.failed(namespace, name, "rejected" if e.status in (400, 403, 422) else "api_error")
                with self._locks_guard:  # the pass did not finish: the next one must still see them
                    self._deleted.setdefault(key, [])[:0] = deleted
                if e.status in (400, 403, 422):
                    message = f"Kubernetes rejected a child: {e.status} {e.reason}: {api_message(e)}"
                    if body is not None and e.status != 403:  # 400/422: something in the spec it cannot take
                        self._report_rejection(body, message)
                    raise kopf.PermanentError(message) from e
                raise kopf.TemporaryError(f"Kubernetes API error {e.status} {e.reason}", delay=5) from e
            except Exception:
                self.metrics.failed(namespace, name, "unexpected")
                raise
            finally:
                if body is not None:
                    self.metrics.duration.labels(namespace, name).observe(time.monotonic() - started)

    def _report_rejection(self, body: dict[str, Any], message: str) -> None:
        """The API server refused a child built from the spec (a pass-through field it validates,
        such as a securityContext or a volume): say so in the status and an Event, not only in logs."""
        previous = body.get("status") or {}
        status = rejected_status(message, generation=(body.get("metadata") or {}).get("generation"),
                                 previous=previous)
        if _condition_of(previous, "SpecValid").get("message") != message:
            self._event(body, "Warning", "Rejected", message)
        try:
            self._write_status(body["metadata"].get("namespace") or "default", body["metadata"]["name"], status,
                               previous)
        except kubernetes.client.ApiException as e:
            log.warning("could not write the status of %s: %s %s", body["metadata"]["name"], e.status, e.reason)

    def _reconcile(self, body: dict[str, Any], deleted: list[dict[str, Any]] = ()) -> dict[str, Any]:
        meta = body.get("metadata") or {}
        namespace, name = meta.get("namespace") or "default", meta["name"]
        generation = meta.get("generation")
        previous = body.get("status") or {}
        spec, spec_error = self._resolve_spec(body)
        was = _condition_of(previous, "SpecValid")
        if spec_error:
            self.metrics.failed(namespace, name, "invalid_spec")
        if spec_error and (was.get("status") != "False" or was.get("message") != spec_error):
            kept = " (the previous spec stays in force)" if spec is not None else ""
            self._event(body, "Warning", "InvalidSpec", spec_error + kept)
        if spec is None:
            status = invalid_status(spec_error, generation=generation, previous=previous)
            self._write_status(namespace, name, status, previous)
            raise kopf.PermanentError(f"InvalidSpec: {spec_error}")

        self.cluster.apply(b.build_headless_service(spec, body))
        self.cluster.apply(b.build_head_service(spec, body))
        self.cluster.apply(b.build_disruption_budget(spec, body))
        model_ready = self._reconcile_model(spec, body, previous)
        adapters = self._reconcile_adapter_downloads(spec, body, previous)
        ready = [s.adapter for s in adapters if s.state == "Ready"]
        if spec.adapters is not None:
            # pods start with the adapters ready now (the others join them later), less those a runtime
            # refused: at start-up the runtime would refuse them too, and the pod would never start
            refused = {a.get("name"): a.get("model") for a in previous.get("adapters") or []
                       if a.get("state") == "LoadFailed"}
            spec = replace(spec, adapters=tuple(a for a in ready if refused.get(a.name) != a.display))
        # Until the model is downloaded, no group is created or moved onto it (see _reconcile_model).
        model_is_ready = model_ready["status"] == "True"
        # Before the groups' StatefulSets: the pods must find their PodGroup when they appear.
        unrealised = self._apply_pod_groups(spec, body)

        owned = {b.LABEL_DEPLOYMENT: name}
        # StatefulSets carry the groups' durable records (epoch, members, backoff): read them
        # consistently. Pods change most and are many: read them from the API server's watch cache.
        statefulsets = self.cluster.list_statefulsets(namespace, owned, cached=False)
        pods = self.cluster.list_pods(namespace, owned)
        groups, extra = self._reconcile_groups(spec, body, statefulsets, pods, deleted, model_is_ready)
        # spec.prefill: the prefill role's groups, rolled and recreated on their own by the same pass
        prefill = prefill_view(spec)
        prefill_groups, prefill_extra = [], 0
        if spec.prefill is not None:
            self.cluster.apply(b.build_prefill_service(spec, body))
        elif previous.get("prefill") is not None:
            self.cluster.delete("Service", namespace, pd.prefill_service_name(spec))
        if spec.prefill is not None or any(pd.role_of(s) == pd.PREFILL for s in statefulsets):
            prefill_groups, prefill_extra = self._reconcile_groups(prefill, body, statefulsets, pods, deleted,
                                                                   model_is_ready)

        adapter_status = self._sync_adapters(spec, body, groups, adapters, ready, previous)
        plan, autoscaler = self._apply_autoscaler(spec, body, previous)
        status = build_status(spec, groups, generation=generation, extra_groups=extra, previous=previous,
                              spec_error=spec_error, now=self.clock(), model_ready=model_ready)
        status = with_prefill_status(status, prefill, prefill_groups, extra_groups=prefill_extra, previous=previous,
                                     now=self.clock(), model_ready=model_ready)
        status = with_autoscaler_status(status, autoscaler)
        status = {**status, **self._apply_router(spec, body, previous), **adapter_status}
        if plan.error:
            unrealised.append(("AutoscalingUnsupported", plan.error))
        status = with_spec_unrealised(status, unrealised, previous, to_iso(self.clock()))
        self.metrics.observe_status(namespace, name, spec.replicas, status)
        before, after = _condition_of(previous, "Degraded"), _condition_of(status, "Degraded")
        if after.get("status") == "True" and after.get("reason") not in ("InvalidSpec", "GroupRestarting") and (
                before.get("status") != "True" or before.get("reason") != after.get("reason")):
            self._event(body, "Warning", after["reason"], after.get("message", ""))
        self._write_status(namespace, name, status, previous)
        return status

    def _reconcile_groups(self, spec: DeploymentSpec, body: dict[str, Any], statefulsets: list[dict[str, Any]],
                          pods: list[dict[str, Any]], deleted: list[dict[str, Any]], model_is_ready: bool
                          ) -> tuple[list[GroupObservation], int]:
        """One role's groups (the main groups, or with spec.prefill the prefill groups of prefill_view): create,
        repair, recreate, roll and scale them, seeing only that role's StatefulSets and pods. Returns the groups
        observed after acting and how many groups above replicas are still being removed."""
        def mine(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [o for o in objects if (pd.role_of(o) == pd.PREFILL) == pd.is_prefill(spec)]

        statefulsets, pods, deleted = mine(statefulsets), mine(pods), mine(deleted)
        extra = self._remove_extra_groups(spec, body, statefulsets)
        groups = self._observe(spec, statefulsets, pods)
        if any(g.lost for g in groups):
            # The cached read may be a moment behind: confirm a loss with a consistent read before
            # recreating a whole group on it.
            pods = mine(self.cluster.list_pods(spec.namespace, {b.LABEL_DEPLOYMENT: spec.name}, cached=False))
            groups = self._observe(spec, statefulsets, pods)
        listed = Listed(statefulsets)

        creating = [g.index for g in groups if not g.exists]
        if creating and model_is_ready:
            self._event(body, "Normal", "ScalingUp", f"{pd.replicas_field(spec)} is {spec.replicas}: creating "
                        f"{pd.group_word(spec)}s {creating}")
        for group in groups:
            if not group.stale and (group.exists or model_is_ready):
                # Create missing groups; repair drift (a deleted or edited StatefulSet) and finish a
                # replacement an earlier pass did not complete. A no-op when everything matches.
                self._replace(spec, body, group, group.record, listed)
        if spec.restart_policy == "RecreateGroupOnPodRestart":
            for group in groups:
                if model_is_ready or not group.stale:  # a stale group's recreation would move it to the new model
                    self._maybe_recreate(spec, body, group, listed, deleted)
        if model_is_ready:
            self._roll(spec, body, groups, listed)
        for group in groups:
            record = backoff_after(group.record, group.ready, self.clock(), self.settings.recreate_backoff_reset_seconds)
            if record != group.record and not group.stale:
                self._apply_group(spec, body, group.index, record, listed)
                group.record = record
        return groups, extra

    # ----- the model cache (spec.model.name) -----

    def _reconcile_model(self, spec: DeploymentSpec, body: dict[str, Any], previous: dict[str, Any]) -> dict[str, str]:
        """Keep a Hub model's cache claim and download Job (model_cache.py) and return the ModelReady
        condition. Groups already serving keep their model while a new one downloads; they are rolled
        onto it only once the Job has succeeded."""
        hub = spec.hub_model
        if hub is None:
            return mc.model_ready_condition(spec, None, current=False)
        if not hub.existing_claim:
            self.cluster.apply(mc.build_cache_claim(spec, body))
        wanted = mc.build_download_job(spec, body)
        name = wanted["metadata"]["name"]
        live = self.cluster.get_job(spec.namespace, name)
        action = mc.job_action(live, wanted)
        if action == "replace":
            log.info("replacing the download Job of %s/%s: now %s", spec.namespace, spec.name, hub.display)
            self.cluster.delete_job(spec.namespace, name)
        if action in ("create", "replace") and self.cluster.create_job(wanted):
            live = wanted  # as created; its status comes with the Job's next watch event
            self._event(body, "Normal", "DownloadStarted",
                        f"Job {name} downloads {hub.display} into claim {hub.claim_name} ({hub.directory})")
        current = mc.job_is_current(live, wanted)
        pod_message = None
        if current and mc.job_download(live).state == "Failed":
            download_pods = {mc.LABEL_DOWNLOAD: spec.name, mc.LABEL_MODEL_HASH: mc.model_hash(hub)}
            pod_message = mc.pod_failure_message(self.cluster.list_pods(spec.namespace, download_pods))
        condition = mc.model_ready_condition(spec, live, current, pod_message)
        before = _condition_of(previous, "ModelReady")
        if condition["reason"] != before.get("reason") or condition["message"] != before.get("message"):
            if condition["reason"] == "Downloaded":
                self._event(body, "Normal", "DownloadSucceeded", condition["message"])
            elif condition["reason"] == "DownloadFailed":
                self._event(body, "Warning", "DownloadFailed", condition["message"])
        return condition

    # ----- LoRA adapters (spec.adapters) -----

    def _reconcile_adapter_downloads(self, spec: DeploymentSpec, body: dict[str, Any],
                                     previous: dict[str, Any]) -> list[ad.AdapterState]:
        """Each Hub adapter's download Job (adapters.py), as the base model's; Jobs of adapters no longer in
        the spec are deleted (their directories stay in the cache claim). Returns every adapter's state."""
        if spec.adapters is None and not previous.get("adapters"):
            return []  # no adapters now or at the last pass: no Job of one to look for
        states = []
        for adapter in spec.adapters or ():
            if adapter.hub is None:
                states.append(ad.AdapterState(adapter))
                continue
            wanted = ad.build_adapter_job(spec, body, adapter)
            name = wanted["metadata"]["name"]
            live = self.cluster.get_job(spec.namespace, name)
            action = mc.job_action(live, wanted)
            if action == "replace":
                self.cluster.delete_job(spec.namespace, name)
            if action in ("create", "replace") and self.cluster.create_job(wanted):
                live = wanted
                self._event(body, "Normal", "DownloadStarted", f"Job {name} downloads adapter {adapter.name} "
                            f"({adapter.display}) into claim {adapter.hub.claim_name} ({adapter.directory})")
            current = mc.job_is_current(live, wanted)
            pod_message = None
            if current and mc.job_download(live).state == "Failed":
                download_pods = {mc.LABEL_DOWNLOAD: spec.name, mc.LABEL_MODEL_HASH: mc.model_hash(adapter.hub)}
                pod_message = mc.pod_failure_message(self.cluster.list_pods(spec.namespace, download_pods))
            state = ad.download_state(adapter, live, current, pod_message)
            before = next((a for a in previous.get("adapters") or [] if a.get("name") == adapter.name), {})
            if state.state == "DownloadFailed" and before.get("message") != state.message:
                self._event(body, "Warning", "DownloadFailed", f"adapter {adapter.name}: {state.message}")
            states.append(state)
        wanted_jobs = {ad.adapter_job_name(spec, a) for a in spec.adapters or () if a.hub is not None}
        for job in self.cluster.list_jobs(spec.namespace, {b.LABEL_DEPLOYMENT: spec.name}):
            name = job["metadata"]["name"]
            if ad.LABEL_ADAPTER in (job["metadata"].get("labels") or {}) and name not in wanted_jobs:
                self.cluster.delete_job(spec.namespace, name)
        return states

    def _sync_adapters(self, spec: DeploymentSpec, body: dict[str, Any], groups: list[GroupObservation],
                       states: list[ad.AdapterState], ready: list, previous: dict[str, Any]) -> dict[str, Any]:
        """Load the ready adapters into each Ready group's head and unload the others (no restart; one a
        runtime refused is tried again each pass); returns the status fields saying which groups serve which."""
        if spec.adapters is None:  # cleared once after the field goes
            return {"adapters": None, "adaptersReady": None} if "adapters" in previous else {}
        wanted = {a.name: a.directory for a in ready}
        by_name = {s.adapter.name: s for s in states}
        api_key = self._runtime_api_key(spec, body) if any(g.ready and not g.stale for g in groups) else None
        for group in groups:
            head = next((p for p in group.current_pods if _label(p, b.LABEL_ROLE) == "head"), None)
            client = self.runtime_client(head, api_key) if head is not None and group.ready and not group.stale \
                else None
            if client is None:
                continue
            try:
                serving, errors = ad.sync_group(client, wanted)
            except ad.AdapterCallError as e:
                log.warning("group %s of %s/%s: cannot reach its runtime for adapters: %s", group.index,
                            spec.namespace, spec.name, e)
                continue
            for name in serving:
                by_name[name].groups.append(group.index)
            for name, error in errors.items():
                if name in by_name:
                    by_name[name].state, by_name[name].message = "LoadFailed", f"group {group.index}: {error}"
        status = ad.adapters_status(states, spec.replicas)
        for entry in status["adapters"]:
            before = next((a for a in previous.get("adapters") or [] if a.get("name") == entry["name"]), {})
            if entry["state"] == "LoadFailed" and before.get("message") != entry.get("message"):
                self._event(body, "Warning", "AdapterLoadFailed", f"adapter {entry['name']}: {entry['message']}")
        return status

    def _runtime_api_key(self, spec: DeploymentSpec, body: dict[str, Any]) -> str | None:
        """The key the runtime requires (adapters.runtime_api_key), read from its Secret when it is in one.
        A Secret the operator cannot read is said in an Event; the calls then go without a key (the runtime
        answers 401, and the adapters stay as they are)."""
        source = ad.runtime_api_key(spec)
        if source is None or source.secret is None:
            return source.value if source is not None else None
        try:
            value = self.cluster.get_secret_value(spec.namespace, source.secret, source.secret_key or "")
        except kubernetes.client.ApiException as e:
            self._event(body, "Warning", "ApiKeyUnreadable", f"cannot read key {source.secret_key} of Secret "
                        f"{source.secret} (PAGODA_API_KEY) for the runtime's adapter endpoints: {e.status} {e.reason}")
            return None
        if value is None and not source.optional:
            self._event(body, "Warning", "ApiKeyUnreadable", f"Secret {source.secret} has no key "
                        f"{source.secret_key} (PAGODA_API_KEY): the runtime's adapter endpoints are called without one")
        return value

    def _resolve_spec(self, body: dict[str, Any]) -> tuple[DeploymentSpec | None, str | None]:
        """The spec to act on, and why the current one is rejected (None when it is valid).

        An invalid edit must not stop the management of the groups still serving: then the last
        valid spec (recorded on the headless Service) is reconciled in full, with the current
        replicas when those are valid, so restarts, scaling and drift repair go on."""
        parse = {"default_image": self.settings.runtime_image, "max_world_size": self.settings.max_world_size}
        try:
            return parse_spec(body, **parse), None
        except InvalidSpec as e:
            error = str(e)
        meta = body.get("metadata") or {}
        namespace = meta.get("namespace") or "default"
        headless = self.cluster.get_service(namespace, f"{meta['name']}-headless")
        source = (((headless or {}).get("metadata") or {}).get("annotations") or {}).get(b.ANNOTATION_VALID_SPEC)
        if not source:
            return None, error
        replicas = (body.get("spec") or {}).get("replicas", 1)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            replicas = (body.get("status") or {}).get("replicas", 1)
        try:
            return parse_spec({**body, "spec": with_replicas(source, replicas)}, **parse), error
        except (InvalidSpec, ValueError) as e:  # e.g. the operator's limits changed since
            log.warning("last valid spec of %s/%s no longer parses: %s", namespace, meta["name"], e)
            return None, error

    def _observe(self, spec: DeploymentSpec, statefulsets: list[dict[str, Any]],
                 pods: list[dict[str, Any]]) -> list[GroupObservation]:
        heads = {_group_of(s): s for s in statefulsets if _label(s, b.LABEL_ROLE) == "head"}
        groups = []
        for index in range(spec.replicas):
            head = heads.get(index)
            record = GroupRecord.from_annotations((head or {}).get("metadata", {}).get("annotations"))
            groups.append(GroupObservation(
                index=index,
                size=spec.pods_per_group,
                wanted_revision=b.group_revision(spec, index, record.epoch, self.settings.cluster_domain),
                revision=_label(head, b.LABEL_REVISION) if head else None,
                record=record,
                pods=[p for p in pods if _group_of(p) == index],
            ))
        for group in groups:
            group.create_errors = self._create_errors(spec, group, statefulsets)
        return groups

    def _create_errors(self, spec: DeploymentSpec, group: GroupObservation,
                       statefulsets: list[dict[str, Any]]) -> list[str]:
        """Why pods the group's StatefulSets want do not exist: read only when pods are missing
        (cheap in steady state), and only what happened since the group got its template."""
        if not group.exists or len(group.current_pods) >= group.size:
            return []
        since = from_iso(group.record.replaced_at)
        errors = []
        for sts in statefulsets:
            if _group_of(sts) != group.index:
                continue
            for cond in (sts.get("status") or {}).get("conditions") or []:
                if cond.get("reason") == "FailedCreate" and cond.get("status") == "True":
                    errors.append(cond.get("message") or "FailedCreate")
            for event in self.cluster.list_events(spec.namespace, "StatefulSet", sts["metadata"]["name"]):
                when = from_iso(event.get("lastTimestamp") or event.get("eventTime") or "")
                if event.get("reason") == "FailedCreate" and (since is None or when is None or when >= since):
                    errors.append(event.get("message") or "FailedCreate")
        return list(dict.fromkeys(errors))

    def _remove_extra_groups(self, spec: DeploymentSpec, body: dict[str, Any],
                             statefulsets: list[dict[str, Any]]) -> int:
        """Scale down: delete whole groups above replicas (their pods go with them). Returns how many."""
        extra = {_group_of(s) for s in statefulsets if _group_of(s) >= spec.replicas}
        removing = sorted(_group_of(s) for s in statefulsets
                          if _group_of(s) >= spec.replicas and not s["metadata"].get("deletionTimestamp")
                          and _label(s, b.LABEL_ROLE) == "head")
        if removing:
            self._event(body, "Normal", "ScalingDown", f"{pd.replicas_field(spec)} is {spec.replicas}: removing "
                        f"{pd.group_word(spec)}s {removing}")
        for sts in statefulsets:
            if _group_of(sts) >= spec.replicas:
                self.cluster.delete_statefulset(spec.namespace, sts["metadata"]["name"])
        return len(extra)

    def _apply_group(self, spec: DeploymentSpec, body: dict[str, Any], index: int, record: GroupRecord,
                     listed: Listed) -> None:
        """Apply the group's StatefulSets, comparing with the copies listed at the start of the pass
        (no extra reads); a copy this pass has written over is dropped, so a later apply reads it."""
        for manifest in b.build_group(spec, body, index, record, self.settings.cluster_domain):
            name = manifest["metadata"]["name"]
            if self.cluster.apply(manifest, live=listed.unwritten.get(name)):
                listed.unwritten.pop(name, None)

    def _replace(self, spec: DeploymentSpec, body: dict[str, Any], group: GroupObservation,
                 record: GroupRecord, listed: Listed, broken: bool = False) -> None:
        """Point the group's StatefulSets at the wanted template, then delete every pod of another
        revision; the StatefulSet controller recreates them all together (Parallel, OnDelete).
        A broken group serves nothing, so its pods skip the graceful drain."""
        revision = b.group_revision(spec, group.index, record.epoch, self.settings.cluster_domain)
        if revision != group.revision:  # the progress deadline starts now
            record = replace(record, replaced_at=to_iso(self.clock()),
                             generation=str((body.get("metadata") or {}).get("generation") or ""))
        self._apply_group(spec, body, group.index, record, listed)
        wanted_names = {m["metadata"]["name"] for m in b.build_group(spec, body, group.index, record)}
        for sts in listed.statefulsets:  # e.g. the worker StatefulSet after pipelineParallelSize became 1
            if _group_of(sts) == group.index and sts["metadata"]["name"] not in wanted_names:
                self.cluster.delete_statefulset(spec.namespace, sts["metadata"]["name"])
        group.record = record
        group.revision = group.wanted_revision = revision
        for pod in group.pods:
            if pod_revision_of(pod) != group.revision:
                self.cluster.delete_pod(spec.namespace, pod["metadata"]["name"],
                                        grace_period_seconds=BROKEN_GROUP_GRACE_SECONDS if broken else None)
        group.pods = [p for p in group.pods if pod_revision_of(p) == group.revision]

    def _maybe_recreate(self, spec: DeploymentSpec, body: dict[str, Any], group: GroupObservation,
                        listed: Listed, deleted: list[dict[str, Any]]) -> None:
        if not group.exists:
            return
        lost = group.lost + [p["metadata"]["name"] for p in deleted if _group_of(p) == group.index
                             and pod_revision_of(p) == group.revision and p["metadata"]["name"] not in group.lost]
        if not (lost or group.restarted or group.record.pending):
            self._record_members(spec, body, group, listed)
            return
        wait = self.recreate_wait(group.record)
        if wait > 0:
            if not group.record.pending:
                log.info("group %s of %s/%s lost a pod; recreating in %.0fs (backoff)",
                         group.index, spec.namespace, spec.name, wait)
                self._event(body, "Warning", "BackOff", f"{pd.group_word(spec)} {group.index} broke again "
                            f"({group.record.recreations} recreations in a row): recreating it in {wait:.0f}s")
                group.record = replace(group.record, pending=True)
                self._apply_group_metadata(spec, body, group, listed)
            return
        why = (f"pods {lost} were lost" if lost else "a pod restarted" if group.restarted
               else "a pod restarted or was lost while it waited for its backoff")
        log.info("recreating group %s of %s/%s: %s", group.index, spec.namespace, spec.name, why)
        self._event(body, "Warning", "RecreatingGroup", f"{pd.group_word(spec)} {group.index}: {why}; replacing "
                    "all its pods "
                    f"(recreation {group.record.recreations + 1} in a row)")
        record = GroupRecord(epoch=group.record.epoch + 1, recreations=group.record.recreations + 1,
                               recreated_at=to_iso(self.clock()), pending=False)
        self.metrics.recreated(spec.namespace, spec.name)
        self._replace(spec, body, group, record, listed, broken=True)

    def _record_members(self, spec: DeploymentSpec, body: dict[str, Any], group: GroupObservation,
                        listed: Listed) -> None:
        """Add newly seen pods of the group to its durable member list (see GroupRecord)."""
        members = {**dict(group.record.members), **group.live_members}
        if group.stale or members == dict(group.record.members):
            return
        group.record = replace(group.record, members=tuple(sorted(members.items())))
        self._apply_group(spec, body, group.index, group.record, listed)

    def _apply_group_metadata(self, spec: DeploymentSpec, body: dict[str, Any], group: GroupObservation,
                              listed: Listed) -> None:
        """Record bookkeeping without touching the pod template (the group keeps its revision)."""
        if group.stale:
            return  # the rollout will replace this group anyway
        self._apply_group(spec, body, group.index, group.record, listed)

    def _roll(self, spec: DeploymentSpec, body: dict[str, Any], groups: list[GroupObservation],
              listed: Listed) -> None:
        """Replace stale groups from `partition` up: a group that is not Ready at once (it serves
        nothing), a Ready one only while fewer than `maxUnavailable` groups are not Ready."""
        unavailable = sum(1 for g in groups if not g.ready)
        for group in groups:
            if not group.stale or group.index < spec.partition:
                continue
            if group.ready:
                if unavailable >= spec.max_unavailable:
                    continue  # keep serving until a group being replaced is Ready
                unavailable += 1
            log.info("rolling group %s of %s/%s to revision %s", group.index, spec.namespace, spec.name,
                     group.wanted_revision)
            # The group got its template at this very generation: the spec did not change, the
            # operator's rendering of it did.
            if group.record.generation and group.record.generation == str(body["metadata"].get("generation")):
                self._event(body, "Warning", "TemplateChanged",
                            f"replacing {pd.group_word(spec)} {group.index}: its pod template changed without a "
                            "spec edit "
                            "(an operator upgrade or a new default runtime image)")
            else:
                self._event(body, "Normal", "RollingUpdate",
                            f"replacing {pd.group_word(spec)} {group.index} with revision {group.wanted_revision}")
            self._replace(spec, body, group, replace(group.record, pending=False, members=()), listed)

    # ----- children of other projects' APIs: autoscalers (spec.autoscaling), PodGroups (spec.scheduling) -----

    def _serves(self, api: tuple[str, str, str]) -> bool:
        """API discovery, cached for discovery_seconds: KEDA or Volcano may be installed any time."""
        now = time.monotonic()
        with self._locks_guard:
            cached = self._discovered.get(api)
        if cached is not None and now - cached[1] < self.settings.discovery_seconds:
            return cached[0]
        served = self.cluster.serves(*api)
        with self._locks_guard:
            self._discovered[api] = (served, now)
        return served

    def _apply_autoscaler(self, spec: DeploymentSpec, body: dict[str, Any],
                          previous: dict[str, Any]) -> tuple[AutoscalerPlan, str | None]:
        """Apply the ScaledObject or HPA spec.autoscaling asks for, delete the one it no longer asks for
        (the kind in use is remembered in status.autoscaler). Returns the plan and the kind now in use."""
        keda = spec.autoscaling is not None and self._serves(KEDA_API)
        plan = plan_autoscaler(spec, body, keda=keda, prometheus_address=self.settings.prometheus_address)
        before = previous.get("autoscaler")
        if plan.error:
            self._event(body, "Warning", "AutoscalingUnsupported", plan.error)
            return plan, before  # an autoscaler already there keeps working
        if before and before != plan.kind:
            # First: KEDA refuses a ScaledObject for a target another HPA already scales.
            self.cluster.delete(before, spec.namespace, spec.name)
            self._event(body, "Normal", "AutoscalerRemoved", f"deleted {before} {spec.name}"
                        + (f": autoscaling now uses a {plan.kind}" if plan.kind else ": spec.autoscaling is gone"))
        if plan.manifest is not None and self.cluster.apply(plan.manifest) and before != plan.kind:
            self._event(body, "Normal", "AutoscalerCreated", f"{plan.kind} {spec.name} scales the groups between "
                        f"{spec.autoscaling.min_replicas} and {spec.autoscaling.max_replicas}")
        return plan, plan.kind

    def _apply_router(self, spec: DeploymentSpec, body: dict[str, Any], previous: dict[str, Any]) -> dict[str, Any]:
        """spec.router's Deployment, Service and permission (router.py), removed when the field goes; and the
        InferencePool whenever the cluster serves that API. Returns the status fields saying what exists."""
        wanted = build_router(spec, body)
        for manifest in wanted:
            self.cluster.apply(manifest)
        before = previous.get("router")
        if wanted and before != router_name(spec):
            if spec.router.mode == "epp":
                self._event(body, "Normal", "RouterCreated", f"Deployment {router_name(spec)} ({spec.router.policy}) "
                            f"is InferencePool {spec.name}'s endpoint picker (Service {router_name(spec)}, gRPC "
                            "port 9002)")
            else:
                self._event(body, "Normal", "RouterCreated", f"Deployment {router_name(spec)} ({spec.router.policy}) "
                            f"routes over the groups; the endpoint is now Service {router_name(spec)}")
        if wanted and before and before != router_name(spec):  # the mode changed: the other name's children go
            for kind in reversed(ROUTER_KINDS):
                self.cluster.delete(kind, spec.namespace, before)
        if not wanted and before:
            for kind in reversed(ROUTER_KINDS):
                self.cluster.delete(kind, spec.namespace, before)
            self._event(body, "Normal", "RouterRemoved", f"spec.router is off: deleted {before}; the endpoint is "
                        f"Service {spec.name} again")
        pool = None
        if self._serves(INFERENCE_POOL_API):
            self.cluster.apply(build_inference_pool(spec, body))
            pool = spec.name
        return {"router": router_name(spec) if wanted else None, "inferencePool": pool}

    def _apply_pod_groups(self, spec: DeploymentSpec, body: dict[str, Any]) -> list[tuple[str, str]]:
        """Volcano PodGroups X-g<i> for groups 0..replicas-1 with gang volcano; delete any others (scaled
        down, or gang changed). Returns why the spec cannot be realised here, if it cannot."""
        wanted = {m["metadata"]["name"]: m for m in b.build_pod_groups(spec, body)}
        if not self._serves(VOLCANO_API):
            if wanted:
                return [("GangSchedulerMissing", "scheduling.gang volcano needs Volcano, which this cluster does "
                         "not serve (no scheduling.volcano.sh/v1beta1 PodGroup API): the pods wait for the volcano "
                         "scheduler")]
            return []
        live = {p["metadata"]["name"]: p for p in
                self.cluster.list_custom("PodGroup", spec.namespace, {b.LABEL_DEPLOYMENT: spec.name})}
        for name, manifest in wanted.items():
            self.cluster.apply(manifest, live=live.get(name))
        for name in sorted(set(live) - set(wanted)):
            self.cluster.delete("PodGroup", spec.namespace, name)
        return []

    def _write_status(self, namespace: str, name: str, status: dict[str, Any], previous: dict[str, Any]) -> None:
        if status_changed(status, previous):
            log.debug("status of %s/%s changes: %s", namespace, name,
                      {k: (previous.get(k), v) for k, v in status.items() if previous.get(k) != v})
            self.cluster.patch_status(namespace, name, status)


def api_message(error: kubernetes.client.ApiException) -> str:
    """The API server's own explanation (the Status object's message), else the raw body."""
    try:
        return json.loads(error.body or "")["message"]
    except (ValueError, KeyError, TypeError):
        return str(error.body or error.reason)


def _condition_of(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == ctype), {})


def _label(obj: dict[str, Any] | None, key: str) -> str | None:
    return (((obj or {}).get("metadata") or {}).get("labels") or {}).get(key)


def _group_of(obj: dict[str, Any]) -> int:
    try:
        return int(_label(obj, b.LABEL_GROUP) or -1)
    except ValueError:
        return -1


__all__ = ["Reconciler"]
