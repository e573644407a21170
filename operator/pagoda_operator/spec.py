"""The LLMDeployment spec as a validated dataclass: defaults applied, cross-field rules checked.

The CRD schema rejects what it can (types, minimums, enums); this module checks what it cannot
(rules across fields, limits that depend on operator settings) and raises InvalidSpec."""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass, field, replace
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_DATA_RPC_PORT = 29550  # vLLM's --data-parallel-rpc-port default (spec.parallelism.dataRPCPort)
# The longest derived name is "<name>-g<group>-worker-<ordinal>" plus the StatefulSet's
# controller-revision-hash label value "<sts>-<hash10>", which must stay within 63 characters.
MAX_NAME_LENGTH = 40
# Flags the operator sets itself; letting extraArgs repeat them would desynchronise the group.
OWNED_FLAGS = (
    "--served-model-name", "--host", "--port", "--tensor-parallel-size", "--pipeline-parallel-size",
    "--nnodes", "--node-rank", "--master-addr", "--master-port", "--shutdown-timeout",
    # spec.parallelism's data-parallel shape (vLLM's flags): every pod of a group must agree on it
    "--data-parallel-size", "-dp", "--data-parallel-size-local", "--data-parallel-address",
    "--data-parallel-rpc-port", "--data-parallel-start-rank", "--data-parallel-rank", "--headless",
)
# Set by the operator when spec.parallelism.expert is given (else the user's, in engine.extraArgs).
EXPERT_FLAGS = ("--enable-expert-parallel", "--no-enable-expert-parallel")
# Flags the operator sets when spec.adapters is given (other LoRA flags, --max-loras, --max-lora-rank, stay
# the user's, in engine.extraArgs).
LORA_FLAGS = ("--enable-lora", "--lora-modules", "--allow-runtime-lora-updating")
# Directories a model volume must not shadow inside the container.
RESERVED_PATHS = ("/dev", "/proc", "/sys", "/etc", "/usr", "/bin", "/lib", "/tmp", "/var/run")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# An extended resource name: a DNS-subdomain prefix and a name (nvidia.com/gpu, amd.com/gpu,
# nvidia.com/mig-1g.10gb).
EXTENDED_RESOURCE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


class InvalidSpec(ValueError):
    """A spec the schema accepted but the operator cannot realise."""


@dataclass(frozen=True)
class EngineSpec:
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    block_size: int | None = None
    enable_prefix_caching: bool | None = None
    gpu_memory_utilization: float | None = None
    dtype: str | None = None
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    namespace: str
    image: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # spec.parallelism: data-parallel ranks per group, and per pod (data / dataLocal pods per group)
    data_parallel_size: int = 1
    data_parallel_size_local: int = 1
    data_parallel_rpc_port: int = DEFAULT_DATA_RPC_PORT
    # parallelism.expert: None when not given (then --enable-expert-parallel may come in engine.extraArgs)
    enable_expert_parallel: bool | None = None
    replicas: int = 1
    model_path: str | None = None
    served_name: str | None = None
    model_volume: dict[str, Any] | None = None
    # A model by Hub id: downloaded into a cache claim by a Job, then served from model_path inside it.
    hub_model: HubModel | None = None
    resources: dict[str, Any] | None = None
    engine: EngineSpec = field(default_factory=EngineSpec)
    restart_policy: str = "RecreateGroupOnPodRestart"
    service_type: str = "ClusterIP"
    service_port: int = 8000
    startup_timeout_seconds: int = 1800
    # Passed through to the pods unchanged.
    node_selector: dict[str, str] | None = None
    tolerations: list[dict[str, Any]] | None = None
    affinity: dict[str, Any] | None = None
    priority_class_name: str | None = None
    image_pull_secrets: list[dict[str, Any]] | None = None
    service_account_name: str | None = None
    env: list[dict[str, Any]] | None = None
    pod_annotations: dict[str, str] | None = None
    pod_labels: dict[str, str] | None = None
    gpu_resource_name: str = GPU_RESOURCE
    # Replace the restricted-profile defaults when set (e.g. to run an image as root).
    pod_security_context: dict[str, Any] | None = None
    security_context: dict[str, Any] | None = None
    termination_grace_period_seconds: int = 90
    # rollout: groups replaced at once, groups below the partition index kept on their revision,
    # and how long a replaced group may take to get Ready before the rollout is reported stalled.
    max_unavailable: int = 1
    partition: int = 0
    progress_deadline_seconds: int | None = None
    # Optional parts (autoscaling.py and scheduling.py build what they ask for); None: not asked for.
    autoscaling: AutoscalingSpec | None = None
    scheduling: SchedulingSpec | None = None
    router: RouterSpec | None = None  # spec.router with enabled: true (router.py builds its children)
    # spec.adapters (LoRA): None without the field (and without engine.enableLora: true); present (even
    # empty), the pods run with LoRA enabled
    adapters: tuple[AdapterSpec, ...] | None = None
    # spec.prefill (P/D disaggregation): the prefill role's own groups; None without the field
    prefill: PrefillSpec | None = None
    # Which P/D role these groups play: None without spec.prefill, "decode" for the main groups with it,
    # "prefill" in disaggregation.prefill_view's copy that builds the prefill groups
    pd_role: str | None = None
    # The spec as the user wrote it, minus replicas: recorded on a child so that the last valid spec
    # keeps being reconciled while a later edit is invalid. Not a pod-shaping field.
    source: str = field(default="", compare=False)

    @property
    def model_name(self) -> str:
        return self.served_name or self.name

    @property
    def model_mount_path(self) -> str | None:
        """Where the model volume is mounted: the whole cache for a Hub model, else model.path."""
        return MODEL_CACHE_PATH if self.hub_model else self.model_path

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def ranks_per_pod(self) -> int:
        """GPU ranks in one pod: its tensor-parallel ranks times its data-parallel ranks."""
        return self.tensor_parallel_size * self.data_parallel_size_local

    @property
    def pods_per_group(self) -> int:
        """One per pipeline stage, or one per dataLocal data-parallel ranks (never both: DP excludes PP)."""
        return self.pipeline_parallel_size * (self.data_parallel_size // self.data_parallel_size_local)

    @property
    def progress_deadline(self) -> int:
        """Default: the model may take startupTimeoutSeconds to load, plus 10 minutes to schedule and pull."""
        return self.progress_deadline_seconds or self.startup_timeout_seconds + 600

    @property
    def gpus_per_pod(self) -> int:
        """GPUs each pod asks for: the explicit resources win, else one per rank (TP x dataLocal)."""
        return gpu_count(self.resources, self.gpu_resource_name, self.ranks_per_pod)


def gpu_count(resources: dict[str, Any] | None, resource_name: str, tensor_parallel_size: int) -> int:
    """GPUs in a resources block (limits first); InvalidSpec for anything but a whole number."""
    if not resources:
        return tensor_parallel_size
    for section in ("limits", "requests"):
        value = (resources.get(section) or {}).get(resource_name)
        if value is None:
            continue
        text = str(value).strip()
        if isinstance(value, bool) or not text.isdigit():
            raise InvalidSpec(f"resources.{section}[{resource_name}] must be a whole number of GPUs, "
                              f"got {value!r}")
        return int(text)
    return 0


def _int(value: Any, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidSpec(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def spec_source(spec: dict[str, Any]) -> str:
    """The user's spec without replicas (scaling must not look like an edit), as stable JSON."""
    return json.dumps({k: v for k, v in spec.items() if k != "replicas"}, sort_keys=True, separators=(",", ":"))


def with_replicas(source: str, replicas: Any) -> dict[str, Any]:
    """A recorded spec with the replicas of the current one, so scaling works on the last valid spec."""
    spec = json.loads(source)
    spec["replicas"] = replicas
    return spec


def parse_spec(
    body: dict[str, Any], *, default_image: str, max_world_size: int = 256
) -> DeploymentSpec:
    """Turn an LLMDeployment object into a DeploymentSpec or raise InvalidSpec with a readable message.

    Whatever the spec holds, the only exception that leaves is InvalidSpec: a value of the wrong shape
    that slipped past the schema (an older CRD, a client that skips validation) is a bad spec too."""
    try:
        return _parse_spec(body, default_image=default_image, max_world_size=max_world_size)
    except InvalidSpec:
        raise
    except (TypeError, ValueError, AttributeError, KeyError) as e:
        raise InvalidSpec(f"the spec has a value of the wrong type or shape: {type(e).__name__}: {e}") from e


def _parse_spec(body: dict[str, Any], *, default_image: str, max_world_size: int) -> DeploymentSpec:
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    name = meta.get("name") or ""
    if len(name) > MAX_NAME_LENGTH or not DNS_LABEL.match(name):
        raise InvalidSpec(
            f"metadata.name {name!r} must be a DNS label of at most {MAX_NAME_LENGTH} characters "
            "(the operator derives StatefulSet and pod names from it)")
    shape = parse_parallelism(spec)
    tp, pp, dp = shape.tensor, shape.pipeline, shape.data
    replicas = _int(spec.get("replicas", 1), "replicas", 0)
    if tp * pp * dp > max_world_size:
        what, sizes = ("tensorParallelSize x parallelism.data", f"{tp} x {dp}") if dp > 1 else \
            ("tensorParallelSize x pipelineParallelSize", f"{tp} x {pp}")
        raise InvalidSpec(f"{what} = {sizes} = {tp * pp * dp} "
                          f"exceeds the operator's limit of {max_world_size} ranks per group")
    if shape.expert and not ((spec.get("model") or {}).get("path") or (spec.get("model") or {}).get("name")):
        raise InvalidSpec(f"parallelism.expert is true but the model is the built-in default ({DEFAULT_MODEL}), "
                          "a dense model with no experts to spread: give spec.model (a mixture-of-experts model) "
                          "or remove parallelism.expert")
    if not ((spec.get("model") or {}).get("path") or (spec.get("model") or {}).get("name")):
        check_default_model_split(tp, "parallelism.tensor" if "tensor" in (spec.get("parallelism") or {})
                                  else "tensorParallelSize")

    model = spec.get("model") or {}
    hub_model = parse_hub_model(name, model)
    path = model.get("path")
    volume = model.get("volume")
    if path is not None:
        normalised = posixpath.normpath(path)
        if not path.startswith("/") or normalised == "/":
            raise InvalidSpec(f"model.path {path!r} must be an absolute path below /, e.g. /models/llama")
        if volume and any(normalised == r or normalised.startswith(r + "/") for r in RESERVED_PATHS):
            raise InvalidSpec(f"model.path {path!r} would mount the model volume over a system "
                              f"directory ({', '.join(RESERVED_PATHS)})")
        path = normalised
    if volume is not None:
        if path is None:
            raise InvalidSpec("model.volume is set but model.path is not: say where to mount the weights")
        sources = [k for k in volume if k != "name"]
        if len(sources) != 1:
            raise InvalidSpec(f"model.volume must hold exactly one volume source, got {sorted(sources)}")

    if hub_model is not None:
        path, volume = hub_model.directory, {"persistentVolumeClaim": {"claimName": hub_model.claim_name,
                                                                       "readOnly": True}}

    resources = spec.get("resources") or None
    gpu_resource_name = spec.get("gpuResourceName") or GPU_RESOURCE
    if not isinstance(gpu_resource_name, str) or not EXTENDED_RESOURCE.match(gpu_resource_name):
        raise InvalidSpec(f"gpuResourceName {gpu_resource_name!r} must be an extended resource name "
                          "such as nvidia.com/gpu, amd.com/gpu or nvidia.com/mig-1g.10gb")
    engine = spec.get("engine") or {}
    enable_lora = engine.get("enableLora")
    if enable_lora is not None and not isinstance(enable_lora, bool):
        raise InvalidSpec(f"engine.enableLora must be true or false, got {enable_lora!r}")
    if enable_lora is False and spec.get("adapters") is not None:
        raise InvalidSpec("spec.adapters needs LoRA, but engine.enableLora is false: remove one of them")
    lora_owned = spec.get("adapters") is not None or enable_lora
    extra_args = tuple(str(a) for a in engine.get("extraArgs") or ())
    for arg in extra_args:
        if arg.split("=", 1)[0] in OWNED_FLAGS:
            raise InvalidSpec(f"engine.extraArgs must not set {arg.split('=', 1)[0]}: "
                              "the operator sets it from the spec")
        if arg.split("=", 1)[0] in EXPERT_FLAGS and shape.expert is not None:
            raise InvalidSpec(f"engine.extraArgs must not set {arg.split('=', 1)[0]} with parallelism.expert: "
                              "the operator sets it from that")
        if arg.split("=", 1)[0] in LORA_FLAGS and lora_owned:
            raise InvalidSpec(f"engine.extraArgs must not set {arg.split('=', 1)[0]} with spec.adapters or "
                              "engine.enableLora: the operator sets it from those")
    grace = _int(spec.get("terminationGracePeriodSeconds", 90), "terminationGracePeriodSeconds", 30)
    rollout = spec.get("rollout") or {}
    max_unavailable = _int(rollout.get("maxUnavailable", 1), "rollout.maxUnavailable", 1)
    partition = _int(rollout.get("partition", 0), "rollout.partition", 0)
    deadline = rollout.get("progressDeadlineSeconds")
    if deadline is not None:
        deadline = _int(deadline, "rollout.progressDeadlineSeconds", 60)
    parsed = DeploymentSpec(
        name=name,
        namespace=meta.get("namespace") or "default",
        image=spec.get("image") or default_image,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        data_parallel_size=dp,
        data_parallel_size_local=shape.data_local,
        data_parallel_rpc_port=shape.data_rpc_port,
        enable_expert_parallel=shape.expert,
        replicas=replicas,
        model_path=path,
        served_name=model.get("servedName"),
        model_volume=dict(volume) if volume else None,
        hub_model=hub_model,
        resources=resources,
        engine=EngineSpec(
            max_model_len=engine.get("maxModelLen"),
            max_num_seqs=engine.get("maxNumSeqs"),
            block_size=engine.get("blockSize"),
            enable_prefix_caching=engine.get("enablePrefixCaching"),
            gpu_memory_utilization=engine.get("gpuMemoryUtilization"),
            dtype=engine.get("dtype"),
            extra_args=extra_args,
        ),
        restart_policy=spec.get("restartPolicy") or "RecreateGroupOnPodRestart",
        service_type=(spec.get("service") or {}).get("type") or "ClusterIP",
        service_port=_int((spec.get("service") or {}).get("port", 8000), "service.port", 1),
        startup_timeout_seconds=_int(spec.get("startupTimeoutSeconds", 1800), "startupTimeoutSeconds", 10),
        node_selector=spec.get("nodeSelector"),
        tolerations=spec.get("tolerations"),
        affinity=spec.get("affinity"),
        priority_class_name=spec.get("priorityClassName"),
        image_pull_secrets=spec.get("imagePullSecrets"),
        service_account_name=spec.get("serviceAccountName"),
        env=spec.get("env"),
        pod_annotations=spec.get("podAnnotations"),
        pod_labels=spec.get("podLabels"),
        gpu_resource_name=gpu_resource_name,
        pod_security_context=spec.get("podSecurityContext"),
        security_context=spec.get("securityContext"),
        termination_grace_period_seconds=grace,
        max_unavailable=max_unavailable,
        partition=partition,
        progress_deadline_seconds=deadline,
        autoscaling=parse_autoscaling(spec.get("autoscaling")),
        scheduling=parse_scheduling(spec.get("scheduling")),
        router=parse_router(spec.get("router")),
        adapters=_lora_adapters(parse_adapters(name, spec.get("adapters"), hub_model, model.get("servedName") or name),
                                enable_lora),
        prefill=parse_prefill(spec.get("prefill"), resources),
        pd_role="decode" if spec.get("prefill") is not None else None,
        source=spec_source(spec),
    )
    check_scheduling(parsed)
    check_prefill(parsed)
    gpus = parsed.gpus_per_pod
    if gpus and gpus < tp:
        raise InvalidSpec(f"resources give {gpus} {gpu_resource_name} per pod but tensorParallelSize is {tp}: "
                          "each pod needs one GPU per tensor-parallel rank")
    if gpus and gpus < parsed.ranks_per_pod:
        raise InvalidSpec(f"resources give {gpus} {gpu_resource_name} per pod but each pod runs "
                          f"parallelism.dataLocal x tensorParallelSize = {shape.data_local} x {tp} = "
                          f"{parsed.ranks_per_pod} ranks: each pod needs one GPU per rank")
    return parsed


# ----- spec.parallelism (KServe LLMInferenceService's names) -----

# What runs when spec.model is left out (the runtime image's built-in model): dense, so it has no experts.
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# Its attention heads and KV heads (config.json's num_attention_heads, num_key_value_heads): the one model
# whose config the operator always knows, without reading it.
DEFAULT_MODEL_HEADS = (9, 3)


def tensor_parallel_sizes(heads: int, kv_heads: int) -> list[int]:
    """The tensor-parallel sizes that split the heads evenly: the runtime's rule (config/resolve.py), which
    refuses the others at start, in every pod of the group, again and again."""
    return [n for n in range(1, heads + 1) if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]


def check_default_model_split(tp: int, field_name: str) -> None:
    heads, kv_heads = DEFAULT_MODEL_HEADS
    fits = tensor_parallel_sizes(heads, kv_heads)
    if tp not in fits:
        raise InvalidSpec(f"{field_name} {tp} does not split the built-in default model's ({DEFAULT_MODEL}) "
                          f"{heads} attention heads ({kv_heads} KV heads) evenly: use one of "
                          f"{', '.join(map(str, fits))}, or give spec.model")
# spec.parallelism's aliases of the older top-level fields.
ALIASES = {"tensor": "tensorParallelSize", "pipeline": "pipelineParallelSize"}


@dataclass(frozen=True)
class Parallelism:
    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    data_local: int = 1
    data_rpc_port: int = DEFAULT_DATA_RPC_PORT
    expert: bool | None = None


def parse_parallelism(spec: dict[str, Any]) -> Parallelism:
    """spec.parallelism with tensorParallelSize and pipelineParallelSize: parallelism.tensor and .pipeline are
    their aliases (one of each pair, or both equal); data / dataLocal pods per group, DP excluding PP."""
    raw = spec.get("parallelism")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InvalidSpec(f"parallelism must be an object {{tensor, pipeline, data, dataLocal, dataRPCPort, "
                          f"expert}}, got {raw!r}")
    sizes = {}
    for alias, field_name in ALIASES.items():
        given = [(f"parallelism.{alias}", raw[alias]) if alias in raw else None,
                 (field_name, spec[field_name]) if field_name in spec else None]
        given = [g for g in given if g is not None]
        for what, value in given:
            _int(value, what, 1)
        if len(given) == 2 and given[0][1] != given[1][1]:
            raise InvalidSpec(f"parallelism.{alias} ({given[0][1]}) and {field_name} ({given[1][1]}) differ: "
                              f"give one of them (parallelism.{alias} is KServe's name for {field_name})")
        sizes[alias] = given[0][1] if given else 1
    data = _int(raw.get("data", 1), "parallelism.data", 1)
    data_local = _int(raw.get("dataLocal", data), "parallelism.dataLocal", 1)
    if data % data_local:
        raise InvalidSpec(f"parallelism.data ({data}) is not a multiple of parallelism.dataLocal ({data_local}): "
                          "each pod runs dataLocal data-parallel ranks, so a group needs data / dataLocal pods")
    if data > 1 and sizes["pipeline"] > 1:
        raise InvalidSpec(f"parallelism.data ({data}) with pipeline parallelism (pipelineParallelSize "
                          f"{sizes['pipeline']}) is not supported: the runtime runs data parallelism with tensor "
                          "parallelism inside each rank only; drop one of them")
    port = raw.get("dataRPCPort", DEFAULT_DATA_RPC_PORT)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidSpec(f"parallelism.dataRPCPort must be a port number (1-65535), got {port!r}")
    expert = raw.get("expert")
    if expert is not None and not isinstance(expert, bool):
        raise InvalidSpec(f"parallelism.expert must be true or false, got {expert!r}")
    return Parallelism(tensor=sizes["tensor"], pipeline=sizes["pipeline"], data=data, data_local=data_local,
                       data_rpc_port=port, expert=expert)


# ----- models from the Hub (spec.model.name): a download Job fills a cache claim -----

# Where the cache claim is mounted, in the download Job (read-write) and in the model pods (read-only).
MODEL_CACHE_PATH = "/models"
DEFAULT_CACHE_SIZE = "50Gi"
CACHE_ACCESS_MODES = ("ReadWriteMany", "ReadWriteOnce")
# The Hub's own rules for ids (huggingface_hub's validate_repo_id): NAME or ORG/NAME, at most 96 characters.
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
# A branch, tag or commit; branches may hold "/" (refs/pr/1).
HUB_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")
QUANTITY = re.compile(r"^([0-9]+(\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")


@dataclass(frozen=True)
class HubModel:
    """spec.model.name and friends, checked. The cache claim holds one directory per model and
    revision, so a new revision downloads next to the one the running groups still read."""
    name: str
    revision: str | None = None
    token_secret: str | None = None     # a Secret in the namespace; its key `token` becomes HF_TOKEN
    claim_name: str = ""                # the operator's `<name>-model`, or the user's existing claim
    existing_claim: bool = False        # true: the user's claim, the operator creates none
    cache_size: str = DEFAULT_CACHE_SIZE
    storage_class_name: str | None = None
    access_mode: str = "ReadWriteMany"

    @property
    def directory(self) -> str:
        """The model's directory in the cache: /models/ORG/NAME/REVISION (a "/" in a branch becomes "--")."""
        return f"{MODEL_CACHE_PATH}/{self.name}/{(self.revision or 'main').replace('/', '--')}"

    @property
    def display(self) -> str:
        return self.name + (f"@{self.revision}" if self.revision else "")


def parse_hub_model(deployment: str, model: dict[str, Any]) -> HubModel | None:
    """spec.model's Hub fields, or None when the model is not named by Hub id."""
    name = model.get("name")
    cache = model.get("cache")
    if name is None:
        stray = [k for k in ("revision", "tokenSecret", "cache") if model.get(k) is not None]
        if stray:
            raise InvalidSpec(f"model.{stray[0]} needs model.name (a Hugging Face Hub id such as ORG/NAME)")
        return None
    if not isinstance(name, str) or len(name) > 96 or not HUB_ID.match(name) or "--" in name or ".." in name:
        raise InvalidSpec(f"model.name {name!r} must be a Hugging Face Hub id, ORG/NAME or NAME "
                          "(letters, digits, '-', '_', '.'; at most 96 characters)")
    for clash in ("path", "volume"):
        if model.get(clash) is not None:
            raise InvalidSpec(f"model.name and model.{clash} exclude each other: a Hub model is downloaded into "
                              f"its cache claim and served from {MODEL_CACHE_PATH}/{name}/<revision>")
    revision = model.get("revision")
    if revision is not None and (not isinstance(revision, str) or len(revision) > 255
                                 or not HUB_REVISION.match(revision) or ".." in revision):
        raise InvalidSpec(f"model.revision {revision!r} must be a branch, tag or commit of the model")
    secret = model.get("tokenSecret")
    if secret is not None and (not isinstance(secret, str) or len(secret) > 253 or not DNS_SUBDOMAIN.match(secret)):
        raise InvalidSpec(f"model.tokenSecret {secret!r} must be the name of a Secret in the namespace")
    cache = cache or {}
    claim = cache.get("claimName")
    if claim is not None:
        if not isinstance(claim, str) or len(claim) > 253 or not DNS_SUBDOMAIN.match(claim):
            raise InvalidSpec(f"model.cache.claimName {claim!r} must be the name of a PersistentVolumeClaim")
        given = [k for k in ("size", "storageClassName", "accessMode") if cache.get(k) is not None]
        if given:
            raise InvalidSpec(f"model.cache.claimName names an existing claim: model.cache.{given[0]} "
                              "applies only to the claim the operator creates")
    size = str(cache.get("size") or DEFAULT_CACHE_SIZE)
    quantity = QUANTITY.match(size)
    if not quantity or float(quantity.group(1)) <= 0:
        raise InvalidSpec(f"model.cache.size {cache.get('size')!r} must be a storage quantity such as 50Gi")
    storage_class = cache.get("storageClassName")
    if storage_class is not None and not isinstance(storage_class, str):
        raise InvalidSpec(f"model.cache.storageClassName {storage_class!r} must be the name of a StorageClass")
    access_mode = cache.get("accessMode") or "ReadWriteMany"
    if access_mode not in CACHE_ACCESS_MODES:
        raise InvalidSpec(f"model.cache.accessMode {access_mode!r} must be one of {', '.join(CACHE_ACCESS_MODES)}")
    return HubModel(name=name, revision=revision, token_secret=secret,
                    claim_name=claim or f"{deployment}-model", existing_claim=claim is not None,
                    cache_size=size, storage_class_name=storage_class, access_mode=access_mode)
# ----- spec.autoscaling -----

# The runtime's own metrics an autoscaler can follow (metric: queue | kvCache); anything else is PromQL.
BUILTIN_METRICS = ("queue", "kvCache")
# Default targets per group: waiting requests, and the fraction of KV-cache blocks in use.
DEFAULT_TARGETS = {"queue": 5.0, "kvCache": 0.8}
URL = re.compile(r"^https?://[^\s/]+(/\S*)?$")


@dataclass(frozen=True)
class AutoscalingSpec:
    min_replicas: int
    max_replicas: int
    metric: str             # "queue", "kvCache" or a PromQL query
    target: float           # per group: desired groups = ceil(metric summed over groups / target)
    prometheus_address: str | None = None  # None: the operator's PAGODA_OPERATOR_PROMETHEUS_ADDRESS

    @property
    def custom_query(self) -> bool:
        return self.metric not in BUILTIN_METRICS


def parse_autoscaling(raw: Any) -> AutoscalingSpec | None:
    if raw is None:
        return None
    if "maxReplicas" not in raw:
        raise InvalidSpec("autoscaling.maxReplicas is required: the most groups the autoscaler may run")
    minimum = _int(raw.get("minReplicas", 1), "autoscaling.minReplicas", 0)
    maximum = _int(raw["maxReplicas"], "autoscaling.maxReplicas", max(1, minimum))
    metric = raw.get("metric", "queue")
    if not isinstance(metric, str) or not metric.strip():
        raise InvalidSpec(f"autoscaling.metric must be queue, kvCache or a PromQL query, got {metric!r}")
    metric = metric.strip()
    near = [m for m in BUILTIN_METRICS if m.lower() == metric.lower() and m != metric]
    if near:  # a mistyped name would otherwise be taken for a PromQL series name that never exists
        raise InvalidSpec(f"autoscaling.metric {metric!r} is not a known metric: did you mean {near[0]}?")
    target = raw.get("target", DEFAULT_TARGETS.get(metric))
    if target is None:
        raise InvalidSpec("autoscaling.target is required with a PromQL metric: the value per group to hold")
    if isinstance(target, bool) or not isinstance(target, (int, float)) or target <= 0:
        raise InvalidSpec(f"autoscaling.target must be a number > 0, got {target!r}")
    if metric == "kvCache" and target > 1:
        raise InvalidSpec(f"autoscaling.target {target} is above 1: kvCache is the fraction of KV-cache blocks "
                          "in use (0.8 = 80%)")
    if minimum == 0 and metric in BUILTIN_METRICS:
        raise InvalidSpec(
            f"autoscaling.minReplicas 0 with metric {metric} could never scale up again: the runtime's metrics "
            "vanish with its last group. Scale to zero needs a PromQL metric that exists while nothing runs "
            "(e.g. your gateway's request rate), or keep minReplicas >= 1")
    address = raw.get("prometheusAddress")
    if address is not None and (not isinstance(address, str) or not URL.match(address)):
        raise InvalidSpec(f"autoscaling.prometheusAddress must be an http(s) URL, got {address!r}")
    return AutoscalingSpec(min_replicas=minimum, max_replicas=maximum, metric=metric, target=float(target),
                           prometheus_address=address)


# ----- spec.scheduling -----

GANGS = ("none", "volcano", "kueue")
# A label key: an optional DNS-subdomain prefix and a name of at most 63 characters.
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
HOSTNAME_KEY = "kubernetes.io/hostname"


@dataclass(frozen=True)
class SchedulingSpec:
    scheduler_name: str | None = None
    gang: str = "none"
    topology_key: str | None = None
    queue: str | None = None  # Volcano Queue (the PodGroups' spec.queue) or Kueue LocalQueue (queue-name label)


def parse_scheduling(raw: Any) -> SchedulingSpec | None:
    if raw is None:
        return None
    gang = raw.get("gang", "none")
    if gang not in GANGS:
        raise InvalidSpec(f"scheduling.gang must be one of {', '.join(GANGS)}, got {gang!r}")
    scheduler = raw.get("schedulerName")
    if scheduler is not None and (not isinstance(scheduler, str) or not DNS_SUBDOMAIN.match(scheduler)):
        raise InvalidSpec(f"scheduling.schedulerName must be a scheduler's name (a DNS subdomain), got {scheduler!r}")
    key = raw.get("topologyKey")
    if key is not None and (not isinstance(key, str) or not LABEL_KEY.match(key)):
        raise InvalidSpec(f"scheduling.topologyKey must be a node label key such as topology.kubernetes.io/zone, "
                          f"got {key!r}")
    queue = raw.get("queue")
    if queue is not None:
        if not isinstance(queue, str) or not DNS_SUBDOMAIN.match(queue):
            raise InvalidSpec(f"scheduling.queue must be a queue's name (a DNS subdomain), got {queue!r}")
        if gang == "none":
            raise InvalidSpec("scheduling.queue names a Volcano Queue or a Kueue LocalQueue: it needs gang "
                              "volcano or kueue")
    return SchedulingSpec(scheduler_name=scheduler, gang=gang, topology_key=key, queue=queue)


def check_scheduling(spec: DeploymentSpec) -> None:
    """Rules across scheduling and the rest of the spec."""
    placement = spec.scheduling
    if placement and placement.topology_key == HOSTNAME_KEY and spec.pods_per_group > 1 and spec.gpus_per_pod:
        what = "pipeline stage" if spec.pipeline_parallel_size > 1 else "data-parallel pod"
        raise InvalidSpec(f"scheduling.topologyKey {HOSTNAME_KEY} would put every {what} of a group on one "
                          f"node, but GPU {what}s must be on different nodes: use a wider domain (a rack, block or "
                          "zone label)")


# ----- spec.router -----

# `pagoda router --policy` (DESIGN.md); the operator passes the value through
ROUTER_POLICIES = ("round-robin", "least-load", "prefix", "session", "precise")


ROUTER_MODES = ("proxy", "epp")
FAILURE_MODES = ("FailOpen", "FailClose")  # the InferencePool's endpointPickerRef.failureMode


@dataclass(frozen=True)
class RouterSpec:
    policy: str = "prefix"
    replicas: int = 1
    resources: dict[str, Any] | None = None
    mode: str = "proxy"  # proxy: Service X-router, the OpenAI endpoint; epp: Service X-epp, the endpoint picker
    failure_mode: str = "FailOpen"
    pd_threshold: int = 0  # with spec.prefill: prompts under this many tokens skip the prefill (llm-d's pd-threshold)
    prefill_timeout_s: int | None = None  # with spec.prefill: `--prefill-timeout` (None: the router's default)


def parse_router(raw: Any) -> RouterSpec | None:
    """None unless spec.router.enabled is true (a disabled block keeps its settings for later)."""
    if raw is None or not raw.get("enabled", False):
        return None
    policy = raw.get("policy", "prefix")
    if policy not in ROUTER_POLICIES:
        raise InvalidSpec(f"router.policy must be one of {', '.join(ROUTER_POLICIES)}, got {policy!r}")
    replicas = _int(raw.get("replicas", 1), "router.replicas", 1)
    resources = raw.get("resources") or None
    if resources is not None and not isinstance(resources, dict):
        raise InvalidSpec(f"router.resources must be a resources block (requests, limits), got {resources!r}")
    mode = raw.get("mode", "proxy")
    if mode not in ROUTER_MODES:
        raise InvalidSpec(f"router.mode must be one of {', '.join(ROUTER_MODES)}, got {mode!r}")
    failure_mode = raw.get("failureMode", "FailOpen")
    if failure_mode not in FAILURE_MODES:
        raise InvalidSpec(f"router.failureMode must be one of {', '.join(FAILURE_MODES)}, got {failure_mode!r}")
    pd_threshold = _int(raw.get("pdThreshold", 0), "router.pdThreshold", 0)
    prefill_timeout = raw.get("prefillTimeoutSeconds")
    if prefill_timeout is not None:
        prefill_timeout = _int(prefill_timeout, "router.prefillTimeoutSeconds", 1)
    return RouterSpec(policy=policy, replicas=replicas, resources=resources, mode=mode, failure_mode=failure_mode,
                      pd_threshold=pd_threshold, prefill_timeout_s=prefill_timeout)


# ----- spec.adapters (LoRA) -----

# Job names "<name>-lora-<adapter>" and the OpenAI model name clients send: a DNS label.
MAX_JOB_NAME = 63


@dataclass(frozen=True)
class AdapterSpec:
    """One entry of spec.adapters: served under `name` (a request's "model"), from a directory in the pod
    (path) or from the Hub (hub: downloaded by a Job into the base model's cache claim)."""
    name: str
    path: str | None = None
    hub: HubModel | None = None

    @property
    def directory(self) -> str:
        """Where the pods read it."""
        return self.hub.directory if self.hub else str(self.path)

    @property
    def display(self) -> str:
        return self.hub.display if self.hub else str(self.path)


def _lora_adapters(adapters: tuple[AdapterSpec, ...] | None, enable_lora: bool | None
                   ) -> tuple[AdapterSpec, ...] | None:
    """engine.enableLora: true keeps LoRA on without spec.adapters (an empty list), so that adding the field
    or removing it never changes the pods' flags (--enable-lora), hence never restarts a group. Unset, LoRA
    is on exactly when spec.adapters is there."""
    if adapters is None and enable_lora:
        return ()
    return adapters


def parse_adapters(deployment: str, raw: Any, base_hub: HubModel | None, served: str
                   ) -> tuple[AdapterSpec, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise InvalidSpec(f"adapters must be a list of {{name, model}}, got {raw!r}")
    adapters: list[AdapterSpec] = []
    for i, entry in enumerate(raw):
        where = f"adapters[{i}]"
        if not isinstance(entry, dict):
            raise InvalidSpec(f"{where} must be an object {{name, model}}, got {entry!r}")
        name = entry.get("name")
        if not isinstance(name, str) or not DNS_LABEL.match(name):
            raise InvalidSpec(f"{where}.name {name!r} must be a DNS label (lower-case letters, digits and '-'): "
                              "clients send it as the request's model, and the download Job is named after it")
        if len(f"{deployment}-lora-{name}") > MAX_JOB_NAME:
            raise InvalidSpec(f"{where}.name {name!r} is too long: the Job {deployment}-lora-{name} would have more "
                              f"than {MAX_JOB_NAME} characters")
        if name in (a.name for a in adapters):
            raise InvalidSpec(f"{where}.name {name!r} is given twice")
        if name == served:
            raise InvalidSpec(f"{where}.name {name!r} is the base model's served name: requests for it would "
                              "not reach the adapter")
        model = entry.get("model") or {}
        if not isinstance(model, dict):
            raise InvalidSpec(f"{where}.model must be an object {{name | path, revision, tokenSecret}}")
        unknown = sorted(set(model) - {"name", "path", "revision", "tokenSecret"})
        if unknown:
            raise InvalidSpec(f"{where}.model.{unknown[0]} is not a field of an adapter's model (name | path, "
                              "revision, tokenSecret)")
        path = model.get("path")
        if (path is None) == (model.get("name") is None):
            raise InvalidSpec(f"{where}.model needs exactly one of name (a Hugging Face Hub id) and path (a "
                              "directory inside the pods)")
        if path is not None:
            stray = [k for k in ("revision", "tokenSecret") if model.get(k) is not None]
            if stray:
                raise InvalidSpec(f"{where}.model.{stray[0]} needs {where}.model.name (a Hub id), not path")
            normalised = posixpath.normpath(str(path))
            if not str(path).startswith("/") or normalised == "/":
                raise InvalidSpec(f"{where}.model.path {path!r} must be an absolute path inside the pods, e.g. a "
                                  "directory on the model volume")
            adapters.append(AdapterSpec(name=name, path=normalised))
            continue
        if base_hub is None:
            raise InvalidSpec(f"{where}.model.name: an adapter from the Hub is downloaded into the base model's "
                              "cache claim, so it needs model.name (the base model from the Hub); otherwise give "
                              f"{where}.model.path")
        try:
            hub = parse_hub_model(deployment, {k: v for k, v in model.items() if k != "path"})
        except InvalidSpec as e:
            raise InvalidSpec(f"{where}.{e}") from None
        adapters.append(AdapterSpec(name=name, hub=HubModel(
            name=hub.name, revision=hub.revision, token_secret=hub.token_secret, claim_name=base_hub.claim_name,
            existing_claim=base_hub.existing_claim)))
    return tuple(adapters)


# ----- spec.prefill (P/D disaggregation; KServe LLMInferenceService's name) -----

PREFILL_FIELDS = ("replicas", "parallelism", "resources")
PREFILL_PARALLELISM_FIELDS = ("tensor", "pipeline", "data", "dataLocal")
# Set by the operator on both roles with spec.prefill (builders via disaggregation.py).
KV_TRANSFER_FLAG = "--kv-transfer-config"


@dataclass(frozen=True)
class PrefillSpec:
    """spec.prefill: the groups that run prompts (kv_producer) for the main groups to decode (kv_consumer)."""
    replicas: int = 1
    tensor: int = 1
    pipeline: int = 1
    resources: dict[str, Any] | None = None  # None: spec.resources, as the main groups


def parse_prefill(raw: Any, main_resources: dict[str, Any] | None) -> PrefillSpec | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidSpec(f"prefill must be an object {{replicas, parallelism, resources}}, got {raw!r}")
    unknown = sorted(set(raw) - set(PREFILL_FIELDS))
    if unknown:
        raise InvalidSpec(f"prefill.{unknown[0]} is not a field of spec.prefill ({', '.join(PREFILL_FIELDS)})")
    replicas = _int(raw.get("replicas", 1), "prefill.replicas", 1)
    shape = raw.get("parallelism")
    shape = {} if shape is None else shape
    if not isinstance(shape, dict):
        raise InvalidSpec(f"prefill.parallelism must be an object {{tensor, pipeline}}, got {shape!r}")
    unknown = sorted(set(shape) - set(PREFILL_PARALLELISM_FIELDS))
    if unknown:
        raise InvalidSpec(f"prefill.parallelism.{unknown[0]} is not a field of prefill.parallelism "
                          "(tensor, pipeline, data, dataLocal)")
    for key in ("data", "dataLocal"):
        value = _int(shape.get(key, 1), f"prefill.parallelism.{key}", 1)
        if value != 1:
            raise InvalidSpec(f"prefill.parallelism.{key} {value} is not supported: a prefill group is one engine "
                              "(scale prefill with prefill.replicas)")
    resources = raw.get("resources")
    if resources is not None and not isinstance(resources, dict):
        raise InvalidSpec(f"prefill.resources must be a resources block (requests, limits), got {resources!r}")
    return PrefillSpec(replicas=replicas, tensor=_int(shape.get("tensor", 1), "prefill.parallelism.tensor", 1),
                       pipeline=_int(shape.get("pipeline", 1), "prefill.parallelism.pipeline", 1),
                       resources=resources or main_resources)


def prefill_view(spec: DeploymentSpec) -> DeploymentSpec:
    """The spec the prefill groups are built from: the main spec with spec.prefill's replicas, shape and
    resources and the prefill role; without spec.prefill, no groups (the pass removes any left over). The
    autoscaler scales the main (decode) groups only."""
    prefill = spec.prefill or PrefillSpec(replicas=0)
    return replace(spec, replicas=prefill.replicas, tensor_parallel_size=prefill.tensor,
                   pipeline_parallel_size=prefill.pipeline, data_parallel_size=1, data_parallel_size_local=1,
                   resources=prefill.resources if spec.prefill else spec.resources, autoscaling=None,
                   adapters=None, pd_role="prefill")


def check_prefill(spec: DeploymentSpec) -> None:
    """Rules across spec.prefill and the rest of the spec."""
    if spec.prefill is None:
        if spec.router is not None and spec.router.pd_threshold:
            raise InvalidSpec("router.pdThreshold needs spec.prefill: without prefill pods every prompt is decoded "
                              "where it is prefilled")
        if spec.router is not None and spec.router.prefill_timeout_s is not None:
            raise InvalidSpec("router.prefillTimeoutSeconds needs spec.prefill: without prefill pods the router "
                              "sends no prefill to wait for")
        return
    router = spec.router
    if router is None or router.mode != "proxy":
        raise InvalidSpec("spec.prefill needs spec.router with enabled: true and mode proxy: the router sends each "
                          "request's prompt to a prefill pod, then its decode to a main pod (mode epp would need a "
                          "routing sidecar beside the decode pods, which the operator does not deploy)")
    if spec.adapters is not None:
        raise InvalidSpec("spec.prefill with spec.adapters (or engine.enableLora) is not supported yet: the prefill "
                          "pods would need the same adapters loaded")
    if spec.scheduling is not None and spec.scheduling.gang != "none":
        raise InvalidSpec(f"spec.prefill with scheduling.gang {spec.scheduling.gang} is not supported yet: the "
                          "prefill groups would need their own pod groups")
    if spec.data_parallel_size > 1:
        raise InvalidSpec(f"parallelism.data {spec.data_parallel_size} with spec.prefill is not supported: the "
                          "KV connector serves engines without data parallelism; scale with replicas")
    # The runtime's NixlConnector reads each rank's shard from the same rank of the prefill engine: both roles
    # need the same TP and PP sizes (a mismatch would recompute every prompt), refused here naming the fields.
    prefill = spec.prefill
    for main_field, main, prefill_field, value in (
            ("tensorParallelSize", spec.tensor_parallel_size, "prefill.parallelism.tensor", prefill.tensor),
            ("pipelineParallelSize", spec.pipeline_parallel_size, "prefill.parallelism.pipeline", prefill.pipeline)):
        if value != main:
            raise InvalidSpec(f"{prefill_field} {value} differs from {main_field} {main}: the runtime's "
                              "NixlConnector moves the KV cache between engines of the same tensor and pipeline "
                              "parallelism (each rank reads its own shard from the same prefill rank)")
    for arg in spec.engine.extra_args:
        if arg.split("=", 1)[0] == KV_TRANSFER_FLAG:
            raise InvalidSpec(f"engine.extraArgs must not set {KV_TRANSFER_FLAG} with spec.prefill: the operator "
                              "sets it on both roles (kv_producer on the prefill pods, kv_consumer on the others)")
    view = prefill_view(spec)
    gpus = view.gpus_per_pod
    if gpus and gpus < view.ranks_per_pod:
        raise InvalidSpec(f"prefill.resources give {gpus} {spec.gpu_resource_name} per pod but "
                          f"prefill.parallelism.tensor is {prefill.tensor}: each pod needs one GPU per rank")
