"""The files we ship for real runs: configs/*.yaml and infra/.

Every config validates and fits the architecture of the model it names (before anyone spends GPU time on it); the
ROCm config keeps the numbers of vime's published Qwen3-8B run; infra YAML parses; the Dockerfiles set the offline and
Ray visibility variables; the compose servers listen on loopback only. Static checks: no Docker, no network.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from vime_core.builtin import RECIPES
from vime_core.config import ConfigError, RunConfig, load_config
from vime_core.models import Qwen3Arch, arch_from_hf_config, check_model_compat

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
INFRA = REPO / "infra"
DOCKERFILES = [INFRA / "Dockerfile.cuda", INFRA / "Dockerfile.rocm"]
ROCM_CONFIG = REPO / "configs" / "qwen3-8b-rocm-colocate.yaml"
QWEN3_GPU_CONFIGS = [
    REPO / "configs" / n for n in ("qwen3-8b-rocm-colocate.yaml", "qwen3-4b-cuda.yaml", "qwen3-30b-a3b.yaml")
]

# Architecture facts of the Qwen3 checkpoints the configs name, from their public config.json on the Hugging Face Hub:
#   Qwen/Qwen3-8B:       hidden 4096, 32 heads, 8 KV heads, 36 layers, MLP 12288, vocab 151936, dense
#   Qwen/Qwen3-4B:       hidden 2560, 32 heads, 8 KV heads, 36 layers, MLP 9728, vocab 151936, dense
#   Qwen/Qwen3-30B-A3B:  hidden 2048, 32 heads, 4 KV heads, 48 layers, vocab 151936, 128 experts of MLP 768 (8 per token)
_QWEN3 = {"model_type": "qwen3", "num_attention_heads": 32, "head_dim": 128, "vocab_size": 151936, "rope_theta": 1e6}
HF_CONFIG: dict[str, dict] = {
    "Qwen/Qwen3-8B": {
        **_QWEN3,
        "hidden_size": 4096,
        "num_key_value_heads": 8,
        "num_hidden_layers": 36,
        "intermediate_size": 12288,
    },
    "Qwen/Qwen3-4B": {
        **_QWEN3,
        "hidden_size": 2560,
        "num_key_value_heads": 8,
        "num_hidden_layers": 36,
        "intermediate_size": 9728,
    },
    "Qwen/Qwen3-30B-A3B": {
        **_QWEN3,
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_key_value_heads": 4,
        "num_hidden_layers": 48,
        "intermediate_size": 6144,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
    },
}

OFFLINE_VARS = {
    "DO_NOT_TRACK": "true",
    "RAY_USAGE_STATS_ENABLED": "0",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "VLLM_NO_USAGE_STATS": "1",
}
NOSET_CUDA = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
NOSET_HIP = "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"


def arch_for(source: str) -> Qwen3Arch:
    """The architecture of the model a config names (builtin recipes are read, HF checkpoints looked up above)."""
    if source.startswith("builtin://"):
        r = RECIPES[source.removeprefix("builtin://")]
        hf = {
            "model_type": "qwen3",
            "hidden_size": r.hidden_size,
            "num_attention_heads": r.num_heads,
            "num_key_value_heads": r.num_kv_heads,
            "head_dim": r.head_dim,
            "num_hidden_layers": r.num_layers,
            "intermediate_size": r.intermediate_size,
            "vocab_size": r.vocab_size,
            "rope_theta": r.rope_theta,
        }
        if r.moe:
            hf.update(
                model_type="qwen3_moe",
                num_experts=r.num_experts,
                num_experts_per_tok=r.experts_per_token,
                moe_intermediate_size=r.intermediate_size,
            )
        return arch_from_hf_config(hf)
    assert source.startswith("hf://"), f"shipped configs should name builtin:// or hf:// models, got {source}"
    repo = source.removeprefix("hf://").split("@", 1)[0]
    assert repo in HF_CONFIG, f"{repo}: add its config.json facts to HF_CONFIG in this test"
    return arch_from_hf_config(HF_CONFIG[repo])


def dockerfile_env(path: Path) -> dict[str, str]:
    """KEY=value pairs set by ENV instructions (backslash continuations joined; comments skipped)."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    env: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"\s*ENV\s+(.*)", line)
        if not m:
            continue
        for key, value in re.findall(r'([A-Za-z_][A-Za-z0-9_]*)=("[^"]*"|\S+)', m.group(1)):
            env[key] = value.strip('"')
    return env


# --------------------------------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------------------------------
def test_expected_configs_are_shipped():
    names = {p.name for p in CONFIGS}
    assert {"tiny-cpu.yaml", "qwen3-8b-rocm-colocate.yaml", "qwen3-4b-cuda.yaml", "qwen3-30b-a3b.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates_and_fits_its_model(path: Path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    check_model_compat(cfg, arch_for(cfg.model.source))
    # the invariants the loop relies on are refused when broken, not merely true of the shipped files (restating
    # them after load_config could never fail: loading checks them)
    breaks = [
        f"train.global_batch_size={cfg.samples_per_rollout + 1}",
        f"eval.pass_k={cfg.eval.n_samples_per_eval_prompt + 1}",
    ]
    if cfg.cluster.colocate:
        breaks.append(f"train.num_devices={2 * cfg.rollout_devices}")
    for override in breaks:
        with pytest.raises(ConfigError, match=re.escape(override.split("=")[0])):
            load_config(path, [override])
    # one sample of maximal length fits a micro-batch
    longest = cfg.data.max_prompt_len + cfg.rollout.max_response_len
    assert cfg.train.max_tokens_per_device >= longest, (path.name, cfg.train.max_tokens_per_device, longest)


@pytest.mark.parametrize("path", QWEN3_GPU_CONFIGS, ids=lambda p: p.name)
def test_gpu_configs_follow_vime_qwen3_defaults(path: Path):
    cfg = load_config(path)
    assert cfg.model.dtype == "bfloat16"
    assert cfg.cluster.platform in ("cuda", "rocm")
    assert cfg.rollout.n_samples_per_prompt == 8
    assert cfg.rollout.temperature == 1.0
    t = cfg.train
    assert (t.lr, t.lr_schedule, t.weight_decay, t.adam_beta1, t.adam_beta2, t.clip_grad) == (
        1e-6,
        "constant",
        0.1,
        0.9,
        0.98,
        1.0,
    )
    assert (cfg.grpo.eps_clip, cfg.grpo.eps_clip_high) == (0.2, 0.28)
    assert (
        not t.sequence_parallel
    )  # vime's value is true; not supported with the local layer spec (see config/train_schema.py)
    assert (cfg.data.prompt_key, cfg.data.label_key) == ("prompt", "label")
    assert [d.name for d in cfg.eval.datasets] == ["aime-2024"]
    assert cfg.eval.n_samples_per_eval_prompt == 16 and cfg.eval.pass_k == 16
    assert cfg.eval.interval == 20 and cfg.checkpoint.save_interval == 20


def test_rocm_config_mirrors_vime_amd_run():
    cfg = load_config(ROCM_CONFIG)
    assert cfg.model.source == "hf://Qwen/Qwen3-8B"
    assert cfg.cluster.platform == "rocm" and cfg.cluster.colocate
    assert cfg.train.num_devices == 2 and cfg.train.tensor_parallel_size == 2
    assert (cfg.rollout.num_engines, cfg.rollout.engine_tensor_parallel_size) == (1, 2)
    assert (cfg.rollout.rollout_batch_size, cfg.rollout.n_samples_per_prompt) == (16, 8)
    assert cfg.rollout.max_response_len == 4096
    assert cfg.train.global_batch_size == 128
    assert cfg.num_steps_per_rollout == 1
    assert cfg.rollout.num_rollout == 100
    assert cfg.train.max_tokens_per_device == 9216
    assert cfg.rollout.gpu_memory_utilization <= 0.5  # colocated: leave room for the trainer


def test_disaggregated_and_moe_layouts():
    cuda = load_config(REPO / "configs" / "qwen3-4b-cuda.yaml")
    assert not cuda.cluster.colocate and cuda.cluster.platform == "cuda"
    assert (cuda.train.num_devices, cuda.train.tensor_parallel_size, cuda.train.data_parallel_size) == (4, 2, 2)
    assert (cuda.rollout.num_engines, cuda.rollout.engine_tensor_parallel_size) == (4, 1)
    assert (cuda.rollout.rollout_batch_size, cuda.rollout.max_response_len, cuda.train.global_batch_size) == (
        32,
        8192,
        256,
    )

    moe = load_config(REPO / "configs" / "qwen3-30b-a3b.yaml")
    assert moe.cluster.colocate and moe.train.num_devices == 8
    assert moe.train.expert_parallel_size == 8 and moe.train.tensor_parallel_size == 1  # MoE + TP needs SP
    # TP must divide the 4 KV heads of Qwen3-30B-A3B, on both sides
    assert 4 % moe.train.tensor_parallel_size == 0 and 4 % moe.rollout.engine_tensor_parallel_size == 0


# --------------------------------------------------------------------------------------------------------------------
# infra
# --------------------------------------------------------------------------------------------------------------------
def test_infra_yaml_parses():
    files = sorted([*INFRA.rglob("*.yaml"), *INFRA.rglob("*.yml")])
    assert INFRA / "compose.yaml" in files and INFRA / "kuberay" / "raycluster.yaml" in files
    for f in files:
        docs = [d for d in yaml.safe_load_all(f.read_text()) if d is not None]
        assert docs, f"{f} holds no YAML document"


def test_raycluster_manifest():
    (rc,) = [d for d in yaml.safe_load_all((INFRA / "kuberay" / "raycluster.yaml").read_text()) if d]
    assert rc["apiVersion"] == "ray.io/v1" and rc["kind"] == "RayCluster"
    spec = rc["spec"]
    pods = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    assert any(
        "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
        for g in spec["workerGroupSpecs"]
        for c in g["template"]["spec"]["containers"]
    )
    for pod in pods:
        for c in pod["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            for k, v in OFFLINE_VARS.items():
                assert env.get(k) == v, (c["name"], k)
            assert env.get(NOSET_CUDA) == "1", c["name"]
            assert env.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0", c["name"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_sets_offline_and_noset_variables(path: Path):
    env = dockerfile_env(path)
    for k, v in OFFLINE_VARS.items():
        assert env.get(k) == v, (path.name, k, env.get(k))
    assert env.get(NOSET_CUDA) == "1"
    if path.name.endswith("rocm"):
        assert env.get(NOSET_HIP) == "1"
    # 0 would make `ray start` refuse to join a multi-node cluster
    assert env.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1") != "0"
    text = path.read_text()
    assert re.search(r'^ENTRYPOINT \["vime-pipeline"\]', text, re.M)
    assert re.search(r"^FROM \S+", text, re.M)


def test_rocm_dockerfile_documents_device_flags_and_installs_amdsmi():
    text = (INFRA / "Dockerfile.rocm").read_text()
    for flag in (
        "--ulimit nofile=1048576:1048576",
        "--device /dev/kfd",
        "--device /dev/dri",
        "--group-add video",
        "--ipc host",
        "--shm-size 16g",
        "HIP_VISIBLE_DEVICES",
    ):
        assert flag in text, flag
    assert "amdsmi" in text and "amd_smi" in text


def test_compose_binds_loopback_only():
    text = (INFRA / "compose.yaml").read_text()
    compose = yaml.safe_load(text)
    assert "0.0.0.0" not in text and "::" not in text
    services = compose["services"]
    assert {"mlflow", "prefect"} <= set(services)
    for name, svc in services.items():
        cmd = svc["command"]
        cmd = cmd.split() if isinstance(cmd, str) else [str(x) for x in cmd]
        assert "--host" in cmd and cmd[cmd.index("--host") + 1] == "127.0.0.1", name
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)
    mlflow_cmd = " ".join(services["mlflow"]["command"])
    assert "--backend-store-uri sqlite:///" in mlflow_cmd and "--artifacts-destination" in mlflow_cmd
    assert str(services["mlflow"]["environment"]["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"]).lower() == "false"
    assert services["prefect"]["command"][:3] == ["prefect", "server", "start"]
    assert compose.get("volumes"), "server state should live in volumes"
