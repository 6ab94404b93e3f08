"""The resume fingerprint is derived from a tag on every config field (FIXED or FREE): every field is classified, the
fixed ones change the fingerprint and the free ones do not, and checkpoints of the hand-kept list (version 1) are
still compared on what they record."""

from __future__ import annotations

import logging
from typing import Annotated

import pytest
from pydantic import BaseModel, Field

from tests.helpers.tiny import REPO, tiny_config
from vime_core.checkpoint import ResumeError, check_resumable
from vime_core.config import RunConfig, load_config
from vime_core.config.fingerprint import FINGERPRINT_VERSION, FIXED, FREE, VERSION_KEY, classified

TINY = REPO / "configs" / "tiny-cpu.yaml"

# The hand-kept list of fingerprint version 1 (RunConfig.fingerprint_fields until the fields were tagged): whole
# sections, or the fields kept of them.
V1_FIELDS = {
    "model": None,
    "grpo": None,
    "seed": None,
    "data": ("source", "prompt_key", "label_key", "apply_chat_template"),
    "rollout": (
        "rollout_batch_size",
        "n_samples_per_prompt",
        "max_response_len",
        "temperature",
        "top_p",
        "top_k",
        "reward",
    ),
    "train": (
        "num_devices",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "expert_parallel_size",
        "global_batch_size",
        "optimizer",
        "lr",
        "min_lr",
        "lr_schedule",
        "lr_warmup_steps",
        "lr_decay_steps",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
    ),
}


def v1_fingerprint(cfg: RunConfig) -> dict:
    """What a checkpoint written before the tags records."""
    d = cfg.model_dump(mode="json")
    return {k: d[k] if keep is None else {f: d[k][f] for f in keep} for k, keep in V1_FIELDS.items()}


# --------------------------------------------------------------------------------------------------------------------
# every field is classified
# --------------------------------------------------------------------------------------------------------------------
def test_every_field_of_every_section_is_tagged_fixed_or_free():
    kinds = classified(RunConfig)
    assert {"train.clip_grad", "rollout.max_staleness", "eval.datasets", "tracking.uri", "seed"} <= set(kinds)
    untagged = sorted(k for k, v in kinds.items() if v is None)
    assert untagged == [], (
        "tag these fields FIXED (changing them changes the training math, what is generated or "
        "rewarded, or the data order) or FREE in vime_core/config/schema.py or train_schema.py"
    )


def test_an_untagged_field_is_found():
    class Probe(BaseModel):
        a: Annotated[int, FIXED, Field(description="a")] = 0
        b: Annotated[int, Field(description="b")] = 0
        c: Annotated[int, FREE, Field(description="c")] = 0

    class Outer(BaseModel):
        inner: Probe = Probe()

    assert classified(Outer) == {"inner.a": "fixed", "inner.b": None, "inner.c": "free"}


def test_the_json_schema_shows_the_tags():
    props = RunConfig.model_json_schema()["$defs"]["TrainConfig"]["properties"]
    assert props["clip_grad"]["resume"] == "fixed" and props["timeout_s"]["resume"] == "free"
    assert props["clip_grad"]["description"].startswith("Clip gradients")


def test_the_hand_kept_fields_are_still_fixed():
    flat = classified(RunConfig)
    v1 = {f"{k}.{f}" for k, keep in V1_FIELDS.items() if keep for f in keep}
    v1 |= {k for k in flat if k.split(".")[0] in ("model", "grpo", "seed")}
    assert {k: flat[k] for k in v1 if flat[k] != "fixed"} == {}


# --------------------------------------------------------------------------------------------------------------------
# what changes the fingerprint
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "override",
    [
        # the fields the hand-kept list missed (issue 12): each changes the training math, the samples or the data order
        "train.clip_grad=0.5",  # the update
        "train.adam_eps=1e-6",  # the update
        "data.shuffle=false",  # the data order
        "rollout.stop=['\\n\\n']",  # what is generated (and trained on)
        "rollout.reward_type=group",  # how a custom reward scores
        "rollout.strict_format=true",  # the reward
        "rollout.custom_generate=pkg.mod:generate",  # what is generated
        "rollout.max_staleness=1",  # which policy generated the samples
        "data.max_prompt_len=33",  # with bad_rows = skip: which prompts are in the set
        # and some of the hand-kept ones
        "train.num_devices=2",
        "grpo.eps_clip=0.1",
        "seed=7",
        "rollout.temperature=0.7",
    ],
)
def test_fixed_fields_change_the_fingerprint(override):
    base = load_config(TINY)
    changed = load_config(TINY, [override])
    assert changed.fingerprint() != base.fingerprint()
    assert changed.fingerprint_fields() != base.fingerprint_fields()


def test_dynamic_sampling_changes_the_fingerprint():
    base = load_config(TINY).fingerprint()
    assert (
        load_config(TINY, ["rollout.dynamic_sampling=true", "rollout.over_sampling_batch_size=8"]).fingerprint() != base
    )


@pytest.mark.parametrize(
    "override",
    [
        "rollout.num_rollout=500",
        "checkpoint.save_interval=3",
        "checkpoint.keep_last=5",
        "rollout.timeout_s=60",
        "train.timeout_s=60",
        "sync.timeout_s=60",
        "rollout.reward_timeout_s=3",
        "eval.interval=2",
        "eval.pass_k=1",
        "tracking.enabled=false",
        "output_dir=/tmp/elsewhere",
        "name=other",
        "train.max_tokens_per_device=4096",
        "train.recompute=full",
        "cluster.num_cpus=3",
        "data.bad_rows=skip",
        "rollout.num_engines=2",
    ],
)
def test_free_fields_leave_the_fingerprint(override):
    assert load_config(TINY, [override]).fingerprint() == load_config(TINY).fingerprint()


def test_the_fingerprint_is_a_short_hash_with_a_version():
    cfg = load_config(TINY)
    assert len(cfg.fingerprint()) == 16 and cfg.fingerprint_fields()[VERSION_KEY] == FINGERPRINT_VERSION == 2


# --------------------------------------------------------------------------------------------------------------------
# resume against checkpoints of this and the previous fingerprint
# --------------------------------------------------------------------------------------------------------------------
def test_a_changed_fixed_field_refuses_the_resume_naming_it(tmp_path):
    state = {"fingerprint_fields": tiny_config(tmp_path).fingerprint_fields()}
    check_resumable(state, tiny_config(tmp_path, "rollout.num_rollout=9"))  # free: no exception
    with pytest.raises(ResumeError, match=r"train\.clip_grad: 1\.0 -> 0\.5.*checkpoint\.start_fresh=true"):
        check_resumable(state, tiny_config(tmp_path, "train.clip_grad=0.5"))


def test_a_version_1_checkpoint_is_compared_on_what_it_records(tmp_path, caplog):
    cfg = tiny_config(tmp_path)
    state = {"fingerprint_fields": v1_fingerprint(cfg)}
    with caplog.at_level(logging.WARNING, logger="vime_core.resume"):
        check_resumable(state, tiny_config(tmp_path, "train.clip_grad=0.5"))  # not recorded by version 1: resumes
    assert "fingerprint version 1" in caplog.text and "train.clip_grad" in caplog.text and "data.shuffle" in caplog.text
    with pytest.raises(ResumeError, match=r"train\.lr: 0\.0001 -> 0\.0003"):  # recorded: still refused
        check_resumable(state, tiny_config(tmp_path, "train.lr=3e-4"))


def test_an_unknown_fingerprint_version_is_refused(tmp_path):
    cfg = tiny_config(tmp_path)
    state = {"fingerprint_fields": {**cfg.fingerprint_fields(), VERSION_KEY: 3}}
    with pytest.raises(ResumeError, match=r"records fingerprint version 3, which this vime-flow \(version 2\) cannot"):
        check_resumable(state, cfg)


def test_a_checkpoint_without_a_fingerprint_is_refused(tmp_path):
    with pytest.raises(
        ResumeError, match=r"records no settings \(its state.json has no fingerprint_fields\).*start_fresh"
    ):
        check_resumable({"fingerprint_fields": {}}, tiny_config(tmp_path))
