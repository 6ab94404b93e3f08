"""The embedded default: a synthetic arithmetic task and tiny Qwen3 / Qwen3-MoE checkpoints warmed up on it.

`builtin://arith` is a dataset in the dapo-math-17k layout (`prompt` = chat messages asking for the answer in
`\\boxed{}`, `label` = the answer). Every problem belongs to exactly one split, decided by a hash of the problem, so
the held-out split (`builtin://arith?split=heldout`) can never overlap training.

`builtin://tiny-qwen3-arith` (dense) and `builtin://tiny-qwen3moe-arith` (4 experts, top-2) are real HF checkpoint
directories (safetensors, config, a BPE tokenizer trained on the task's text, chat template, EOS). Each is warmed up
by a short supervised run that stops as soon as the sampled (temperature 1) accuracy on a validation slice of the
*train* split reaches the recipe's target, so RL starts from a model that solves some problems but not most.
They are built once on first use and cached under `<cache>/builtin/<name>-<recipe hash>/`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import parse_qs, urlparse

from vime_core.fsutil import replacing_dir

log = logging.getLogger(__name__)

ARITH_SPLITS = ("train", "heldout")
HELDOUT_PERCENT = 10
SYSTEM_HINT = "Put the final answer in \\boxed{}."
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_dir() -> Path:
    return Path(os.environ.get("VIME_CACHE_DIR", Path.home() / ".cache" / "vime-flow"))


# --------------------------------------------------------------------------------------------------------------------
# the arithmetic task
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a * self.b

    @property
    def text(self) -> str:
        return f"{self.a} {self.op} {self.b}"

    @property
    def split(self) -> str:
        h = int(hashlib.sha256(self.text.encode()).hexdigest()[:8], 16)
        return "heldout" if h % 100 < HELDOUT_PERCENT else "train"


def all_problems() -> list[Problem]:
    """Two-digit addition and two-digit by one-digit multiplication: 11,000 problems."""
    probs = [Problem(a, "+", b) for a in range(100) for b in range(100)]
    probs += [Problem(a, "*", b) for a in range(100) for b in range(10)]
    return probs


def problems(split: str) -> list[Problem]:
    if split not in ARITH_SPLITS:
        raise ValueError(f"builtin://arith has splits {ARITH_SPLITS}, not {split!r}")
    return [p for p in all_problems() if p.split == split]


_PROMPTS = ("What is {q}?", "Compute {q}.", "Calculate {q}.", "Find the value of {q}.")


def prompt_text(p: Problem) -> str:
    template = _PROMPTS[(p.a * 7 + p.b * 3 + ord(p.op)) % len(_PROMPTS)]
    return f"{template.format(q=p.text)} {SYSTEM_HINT}"


def response_text(p: Problem) -> str:
    """The warm-up target: digit-by-digit working, then the boxed answer.

    Each step is a one-digit fact, which a two-layer model learns in a few hundred steps and which carries over to
    held-out problems (they are made of the same facts); a direct answer would need the carry logic in one token.
    """
    a1, a10 = p.a % 10, p.a // 10
    if p.op == "+":
        units = a1 + p.b % 10
        tens = a10 + p.b // 10 + units // 10
        return f"{a1} + {p.b % 10} = {units}, {a10} + {p.b // 10} + {units // 10} = {tens}, so \\boxed{{{p.answer}}}"
    units = a1 * p.b
    tens = a10 * p.b + units // 10
    return f"{a1} * {p.b} = {units}, {a10} * {p.b} + {units // 10} = {tens}, so \\boxed{{{p.answer}}}"


def arith_rows(split: str = "train", size: int | None = None, seed: int = 0) -> list[dict]:
    """Rows in the dapo-math-17k layout, in a fixed shuffled order (the data buffer reshuffles per epoch)."""
    probs = problems(split)
    random.Random(f"arith-{split}-{seed}").shuffle(probs)
    if size is not None:
        probs = probs[:size]
    return [
        {
            "prompt": [{"role": "user", "content": prompt_text(p)}],
            "label": str(p.answer),
            "metadata": {"problem": p.text},
        }
        for p in probs
    ]


def parse_builtin_dataset(uri: str) -> list[dict]:
    """`builtin://arith[?split=train|heldout][&size=N][&seed=S]` -> rows."""
    u = urlparse(uri)
    if u.netloc != "arith":
        raise ValueError(f"unknown builtin dataset {uri!r}; available: builtin://arith[?split=train|heldout&size=N]")
    q = {k: v[-1] for k, v in parse_qs(u.query).items()}
    unknown = set(q) - {"split", "size", "seed"}
    if unknown:
        raise ValueError(f"{uri}: unknown parameter(s) {sorted(unknown)}; allowed: split, size, seed")
    size = int(q["size"]) if "size" in q else None
    return arith_rows(q.get("split", "train"), size, int(q.get("seed", 0)))


# --------------------------------------------------------------------------------------------------------------------
# the tiny models
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelRecipe:
    """Everything that determines a builtin checkpoint; its hash names the cache directory."""

    name: str
    vocab_size: int = 384
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    # MoE variant: upcycled from the warmed-up `moe_base` (every expert a noisy copy of its dense MLP, router random).
    # It needs no warm-up of its own: any further training at this point lifts accuracy far out of the band.
    moe_base: str | None = None
    num_experts: int = 4
    experts_per_token: int = 2
    expert_noise: float = 0.25
    # warm-up: AdamW on the train split minus a validation slice, until sampled accuracy on that slice >= target
    target_accuracy: float = 0.25
    min_warmup_steps: int = 150
    max_warmup_steps: int = 1000
    eval_every: int = 25
    batch_size: int = 64
    lr: float = 3e-3
    val_size: int = 256
    seed: int = 0
    version: int = 3

    @property
    def moe(self) -> bool:
        return self.moe_base is not None

    def digest(self) -> str:
        parts = asdict(self)
        if self.moe_base:
            parts["base_digest"] = RECIPES[self.moe_base].digest()
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


RECIPES: dict[str, ModelRecipe] = {
    "tiny-qwen3-arith": ModelRecipe(name="tiny-qwen3-arith"),
    "tiny-qwen3moe-arith": ModelRecipe(name="tiny-qwen3moe-arith", moe_base="tiny-qwen3-arith", max_warmup_steps=0),
}


def builtin_model_path(name: str) -> Path:
    """Path of a builtin checkpoint, building it on first use (cross-process safe)."""
    if name not in RECIPES:
        raise ValueError(f"unknown builtin model {name!r}; available: {', '.join('builtin://' + n for n in RECIPES)}")
    recipe = RECIPES[name]
    target = cache_dir() / "builtin" / f"{name}-{recipe.digest()}"
    if (target / "vime_builtin.json").exists():
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "vime_builtin.json").exists():
            return target
        log.info("building %s (first use; cached in %s)", name, target)
        with replacing_dir(target) as tmp:
            build_model(recipe, tmp)
    return target


def _corpus(n: int = 6000, seed: int = 0) -> Iterator[str]:
    """Text the tokenizer is trained on: chat-formatted prompts and responses of the task."""
    rng = random.Random(seed)
    probs = all_problems()
    for _ in range(n):
        p = rng.choice(probs)
        yield f"<|im_start|>user\n{prompt_text(p)}<|im_end|>\n<|im_start|>assistant\n{response_text(p)}<|im_end|>\n"


def build_tokenizer(vocab_size: int):
    """Byte-level BPE with digits split one by one (as Qwen's tokenizer does), trained on the task's text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, "<|im_start|>", EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=["<|im_start|>"],
        model_max_length=512,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def _hf_config(recipe: ModelRecipe, tok):
    common = dict(
        # like Qwen3, the embedding has more rows than the tokenizer has tokens (rounded up for tensor parallelism)
        vocab_size=max(recipe.vocab_size, len(tok)),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_position_embeddings,
        rope_theta=recipe.rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    if recipe.moe:
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common,
            num_experts=recipe.num_experts,
            num_experts_per_tok=recipe.experts_per_token,
            moe_intermediate_size=recipe.intermediate_size,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            mlp_only_layers=[],
            output_router_logits=False,
        )
    from transformers import Qwen3Config

    return Qwen3Config(**common)


def _encode_examples(tok, probs: list[Problem]) -> list[tuple[list[int], int]]:
    """(token ids of prompt+response+EOS, prompt length) per problem."""
    out = []
    for p in probs:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": prompt_text(p)}], add_generation_prompt=True, tokenize=False
        )
        ids_p = tok(prompt, add_special_tokens=False)["input_ids"]
        ids_r = tok(response_text(p), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append((ids_p + ids_r, len(ids_p)))
    return out


def sampled_accuracy(model, tok, probs: list[Problem], max_new_tokens: int = 48, seed: int = 0) -> float:
    """Fraction of problems whose temperature-1 sample has the right boxed answer (one sample each)."""
    import torch

    from vime_core.rewards import math_reward

    model.eval()
    enc = [
        tok.apply_chat_template(
            [{"role": "user", "content": prompt_text(p)}], add_generation_prompt=True, tokenize=False
        )
        for p in probs
    ]
    tok.padding_side = "left"
    batch = tok(enc, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            **batch,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_new_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    texts = tok.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    model.train()
    return sum(math_reward(t, str(p.answer)) for t, p in zip(texts, probs)) / len(probs)


def _initial_model(recipe: ModelRecipe):
    """(model, tokenizer): a fresh dense model, or the MoE upcycled from its dense base."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not recipe.moe:
        from transformers import Qwen3ForCausalLM

        tok = build_tokenizer(recipe.vocab_size)
        return Qwen3ForCausalLM(_hf_config(recipe, tok)).float(), tok
    from transformers import Qwen3MoeForCausalLM

    base_dir = builtin_model_path(recipe.moe_base)
    tok = AutoTokenizer.from_pretrained(base_dir)
    dense = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    moe = Qwen3MoeForCausalLM(_hf_config(recipe, tok)).float()
    dsd, msd = dense.state_dict(), moe.state_dict()
    with torch.no_grad():
        for name, t in msd.items():
            if name in dsd:
                t.copy_(dsd[name])
        for i in range(recipe.num_layers):
            p = f"model.layers.{i}.mlp."
            gate_up = torch.cat([dsd[p + "gate_proj.weight"], dsd[p + "up_proj.weight"]], 0)
            down = dsd[p + "down_proj.weight"]
            # identical experts + normalised top-k weights would be the dense MLP; noise of a third of the weights'
            # scale makes the experts really differ (so a wrong expert mapping shows), the warm-up repairs the damage
            for key, w in ((p + "experts.gate_up_proj", gate_up), (p + "experts.down_proj", down)):
                msd[key].copy_(w.expand_as(msd[key]) + torch.randn_like(msd[key]) * w.std() * recipe.expert_noise)
    return moe, tok


def build_model(recipe: ModelRecipe, out: Path) -> dict:
    """Initialise (or upcycle) the model and warm it up; write an HF checkpoint directory to `out`."""
    import torch

    t0 = time.time()
    torch.manual_seed(recipe.seed)
    rng = random.Random(recipe.seed)
    model, tok = _initial_model(recipe)
    train_probs = problems("train")
    rng.shuffle(train_probs)
    val, fit = train_probs[: recipe.val_size], train_probs[recipe.val_size :]
    examples = _encode_examples(tok, fit)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0, betas=(0.9, 0.98))
    history = []
    acc = 0.0
    step = 0
    model.train()
    for step in range(1, recipe.max_warmup_steps + 1):
        loss = _sft_loss(model, rng.sample(examples, recipe.batch_size), tok.pad_token_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step >= recipe.min_warmup_steps and step % recipe.eval_every == 0:
            acc = sampled_accuracy(model, tok, val, seed=step)
            history.append({"step": step, "loss": round(loss.item(), 4), "val_sampled_accuracy": acc})
            log.info("warm-up %s step %d loss %.3f val acc %.3f", recipe.name, step, loss.item(), acc)
            if acc >= recipe.target_accuracy:
                break
    if not history:
        acc = sampled_accuracy(model, tok, val, seed=step)
        history.append({"step": step, "val_sampled_accuracy": acc})
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.padding_side = "left"
    tok.save_pretrained(out)
    info = {
        "recipe": asdict(recipe),
        "recipe_digest": recipe.digest(),
        "warmup_steps": step,
        "val_sampled_accuracy": acc,
        "history": history,
        "build_seconds": round(time.time() - t0, 1),
        "params": sum(p.numel() for p in model.parameters()),
    }
    (out / "vime_builtin.json").write_text(json.dumps(info, indent=2))
    return info


def _sft_loss(model, batch: list[tuple[list[int], int]], pad_id: int):
    """Next-token cross-entropy on response tokens only (prompt tokens are context)."""
    import torch

    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for i, (ids, plen) in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, plen : len(ids)] = torch.tensor(ids[plen:])
    logits = model(input_ids=input_ids).logits[:, :-1]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )
