"""Typed topology declaration: ``PipelineConfig`` and ``StageConfig``.

A pipeline is a list of stages (list order = build order inside one process). A request
enters at ``entry_stage`` and flows along ``next`` edges (optionally narrowed per request
by ``route_fn``) until it reaches terminal stages; stages may also stream chunks to other
stages along ``stream_to`` edges. Fan-in stages (``wait_for``) wait for the payloads of
several sources and combine them with ``merge_fn``.

Dynamic hooks are dotted paths (``"package.module:function"`` or ``"package.module.function"``)
so a config is plain data: it round-trips through YAML and is rebuilt in child processes.
Hook signatures (``payload`` is a :class:`omnistage.core.messages.StagePayload`):

- ``route_fn(payload) -> str | list[str]``: the subset of ``next`` this request goes to.
- ``wait_for_fn(payload) -> list[str]``: the subset of ``wait_for`` this request waits for.
- ``merge_fn(payloads: dict[str, StagePayload]) -> Any``: the merged stage input ``data``.
- ``stream_done_to_fn(payload) -> list[str]``: the subset of ``stream_to`` this request
  streams to (and sends stream-done to).
- ``terminal_stages_fn(request) -> list[str]``: the terminal stages this request ends at.

Hooks must decide from ``payload.request`` (the per-request decision), not from
intermediate data: that is what lets :func:`omnistage.pipeline.topology.check_consistency`
prove at build time, on the model's sample requests, that no request can wait for an input
that never comes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class FactoryConfig(_Strict):
    """Where a stage's scheduler comes from.

    ``path`` is a dotted path to a callable ``factory(ctx: StageBuildContext, **args) ->
    Scheduler``; ``args`` are its keyword arguments (the stage's tunable knobs).
    """

    path: str
    args: dict[str, Any] = Field(default_factory=dict)


class StageResources(_Strict):
    """What a stage needs from the node it runs on, under ``placement: ray``: the bundle of
    its process group's Ray actor is the sum over the group's stages (Ray's logical
    resources: they decide where the actor goes, they do not limit what it uses). Under
    ``placement: local`` they are not used."""

    cpus: float = Field(default=1.0, ge=0, description="logical CPUs (Ray's CPU resource)")
    gpus: float = Field(default=0.0, ge=0, description="GPUs (Ray sets CUDA_VISIBLE_DEVICES to them)")
    custom: dict[str, float] = Field(
        default_factory=dict,
        description="custom node resources, e.g. {thinker: 1} to run on the node started "
        "with --resources '{\"thinker\": 1}'",
    )


class StageConfig(_Strict):
    """One stage of a pipeline. See the module docstring for the hook signatures."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    factory: FactoryConfig
    process: str | None = Field(
        default=None,
        description="process group; None runs the stage in the coordinator's process",
    )
    device: str = Field(default="cpu", description='torch device, e.g. "cpu" or "cuda:0"')
    replicas: int = Field(
        default=1,
        ge=1,
        description="copies of this stage's process group (every stage of a group declares "
        "the same count; a stage in the server process has one); each request runs on one "
        "replica of each group, the one with the fewest requests in flight when it arrives",
    )
    resources: StageResources = Field(default_factory=StageResources)

    next: list[str] = Field(default_factory=list)
    terminal: bool = False
    route_fn: str | None = None

    wait_for: list[str] = Field(default_factory=list)
    wait_for_fn: str | None = None
    merge_fn: str | None = None

    stream_to: list[str] = Field(default_factory=list)
    stream_done_to_fn: str | None = None
    can_accept_stream_before_payload: bool = False

    payload_type: str | None = Field(
        default=None,
        description="dotted path of the class of this stage's payload data (what its "
        "incoming `next` edges carry); None: undeclared",
    )
    result_type: str | None = Field(
        default=None,
        description="dotted path of the class of this stage's result (what its outgoing "
        "`next` edges carry; a terminal's result for the client); None: undeclared",
    )
    stream_types: list[str] = Field(
        default_factory=list,
        description="dotted paths of the classes of the items this stage streams (to its "
        "`stream_to` stages, or the client when terminal); empty: undeclared",
    )
    accepts_stream_types: list[str] = Field(
        default_factory=list,
        description="dotted paths of the classes this stage takes on its stream edges; "
        "empty: undeclared",
    )
    accepts_client_input: list[str] = Field(
        default_factory=list,
        description="dotted paths of the classes of the input a client sends into its "
        "running request, which this stage takes (at most one stage per pipeline); "
        "empty: it takes none",
    )

    @model_validator(mode="before")
    @classmethod
    def _next_as_list(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("next"), str):
            data = {**data, "next": [data["next"]]}
        return data


class PipelineConfig(_Strict):
    """A whole pipeline: its stages and the coordinator's request policy.

    Model packages subclass this to set defaults (stages, hooks, sample requests).
    """

    name: str = "pipeline"
    model_path: str | None = None
    stages: list[StageConfig]
    entry_stage: str | None = Field(default=None, description="default: the first stage")
    terminal_stages_fn: str | None = None
    sample_requests_fn: str | None = Field(
        default=None,
        description="dotted path to a function returning the model's sample requests "
        "(list of (label, request)); the build-time consistency check runs every dynamic "
        "hook on each of them",
    )
    placement: Literal["local", "ray"] = Field(
        default="local",
        description="where process groups run: local (one spawned process each, on this "
        "host) or ray (one Ray actor each, in one placement group of the Ray cluster at "
        "ray_address)",
    )
    ray_address: str | None = Field(
        default=None,
        description="placement ray: the cluster to join (e.g. 10.0.0.1:6379, as printed by "
        "`ray start --head`); None: a private single-node Ray instance started with the server",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        default="PACK",
        description="placement ray: Ray placement-group strategy for the process groups' bundles",
    )
    max_concurrent_requests: int = Field(default=64, ge=1)
    stream_queue_max_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=1,
        description="global cap on stream bytes queued for clients; when a chunk would "
        "exceed it, the request holding the most unread bytes is aborted (never a client "
        "that reads)",
    )
    stream_request_max_bytes: int = Field(
        default=32 * 1024 * 1024,
        ge=1,
        description="cap on one request's unread stream bytes (32 MiB: ~5.8 min of 24 kHz "
        "float32 audio ahead of its client; at most stream_queue_max_bytes); a client that "
        "stops reading past it is aborted (499) and its bytes released",
    )
    request_timeout_s: float | None = Field(default=600.0, gt=0)
    process_death_timeout_s: float = Field(
        default=2.0, gt=0, description="bound on detecting a dead stage process"
    )
    max_stage_restarts: int = Field(
        default=3,
        ge=0,
        description="restarts of one dead stage process allowed within "
        "stage_restart_window_s; one more and the pipeline gives up (the server exits "
        "non-zero, for its supervisor to restart it)",
    )
    stage_restart_window_s: float = Field(
        default=600.0, gt=0, description="the window max_stage_restarts counts in, seconds"
    )
    stage_restart_backoff_s: float = Field(
        default=0.5,
        ge=0,
        description="wait before the first restart of a dead stage process, seconds; "
        "doubled at each restart within the window, at most 30 s",
    )

    @model_validator(mode="after")
    def _replicas_per_group(self) -> PipelineConfig:
        counts: dict[str, tuple[str, int]] = {}
        for stage in self.stages:
            group = stage.process or "main"
            if group == "main" and stage.replicas != 1:
                raise ValueError(
                    f"stage {stage.name!r}: replicas={stage.replicas} needs a process group "
                    "(set its `process`); the server process has one copy of its stages"
                )
            first = counts.setdefault(group, (stage.name, stage.replicas))
            if first[1] != stage.replicas:
                raise ValueError(
                    f"stage {stage.name!r}: replicas={stage.replicas}, but stage {first[0]!r} of "
                    f"the same process group {group!r} has replicas={first[1]}"
                )
        return self

    @property
    def entry(self) -> str:
        """Name of the entry stage."""
        return self.entry_stage or self.stages[0].name

    def stage(self, name: str) -> StageConfig:
        """The stage named ``name``; KeyError if absent."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)
