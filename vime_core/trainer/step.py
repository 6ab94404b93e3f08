"""The training step of a trainer rank: the forward (packed micro-batches -> response-token log-probs), the old and
reference log-probs, `train` (one rollout step: `num_steps_per_rollout` optimizer steps) and `_optimizer_step`, and
the reductions over data-parallel ranks. The loss of a micro-batch is vime_core.loss; the optimizer behind
`self.st.optim` is vime_core.trainer.optim.

Per rollout step (`train`): the log-probs of the rollout tokens under the current policy (the "old" log-probs of
PPO; their distance to vLLM's is `train/train_rollout_logprob_abs_diff`: a no-grad forward first, or with one step per
rollout the training forward's own, see `train.old_logprobs`), then the optimizer steps, each over micro-batches
packed by a token budget, gradients summed over data-parallel ranks and clipped by the global norm computed across
tensor- and expert-parallel ranks.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from vime_core.loss import (
    METRIC_KEYS,
    MicroBatch,
    loss_scale,
    lr_at,
    micro_batch_loss,
    step_denominator,
    step_train_metrics,
)
from vime_core.memory import to_device, train_step_memory
from vime_core.metrics import ROUTING_METRICS
from vime_core.trainer.batching import TrainSample, lockstep_pads, pack_micro_batches, pad_samples
from vime_core.trainer.routing import measures_routing
from vime_core.trainer.state import RankState


class StepRunner:
    """A trainer rank's training step over its `RankState` (vime_core.trainer.state): the forward, the old and
    reference log-probs, `train` and the optimizer steps; `st.step` counts the optimizer steps taken."""

    def __init__(self, st: RankState):
        self.st = st

    # -- forward ------------------------------------------------------------------------------------------------------
    def forward(
        self, model, batch: list[TrainSample], with_entropy: bool, replay: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Log-probs (and entropy) of every response token of `batch`, concatenated; and each token's sample index.

        The samples are packed into one row (megatron's thd format: positions and attention restart per sample, see
        vime_core.attention); the log-probs come from the final hidden states chunk by chunk (vime_core.logprobs)."""
        from vime_core import megatron_model as mm
        from vime_core.attention import packed_seq_params
        from vime_core.logprobs import chunked_logprobs

        lens = [len(s.tokens) for s in batch]
        ids = to_device([t for s in batch for t in s.tokens], torch.long, self.st.device)
        packed = packed_seq_params(lens, self.st.device)  # its layout holds each token's position in its sample
        gpt = mm.unwrap(model)
        if self.st.cfg.rollout.routing_replay and replay:  # R3: the routers take vLLM's experts (trainer/routing.py)
            self._set_routing(gpt, batch)
        with mm.hidden_states_only(gpt):
            hidden = model(
                input_ids=ids.unsqueeze(0),
                position_ids=packed.vime_layout.positions.unsqueeze(0),
                attention_mask=None,
                packed_seq_params=packed,
            )  # [tokens, 1, h]
        # position t predicts token t+1: gather the positions that predict response tokens
        cols, sample_ids, start = [], [], 0
        for i, s in enumerate(batch):
            r = s.response_len
            cols += range(start + s.prompt_len - 1, start + s.prompt_len - 1 + r)
            sample_ids += [i] * r
            start += len(s.tokens)
        if not cols:  # padding alone (lockstep_pads): no log-prob, but a graph through every layer for backward
            nothing = (hidden.sum() * 0.0).expand(0)
            return nothing, nothing if with_entropy else None, to_device([], torch.long, self.st.device)
        cols_t = to_device(cols, torch.long, self.st.device)
        picked = hidden.squeeze(1).index_select(0, cols_t)
        # logits / temperature, softmax over the tokens top-k / top-p kept: vLLM's processed log-probs
        r = self.st.cfg.rollout
        logp, ent = chunked_logprobs(
            picked,
            mm.output_weight(gpt),
            ids.index_select(0, cols_t + 1),
            r.temperature,
            with_entropy,
            self.st.cfg.train.logprob_chunk_tokens,
            keep_logits=self.st.cfg.train.logprob_keep_logits,  # only where backward will run
            top_k=r.top_k,
            top_p=r.top_p,
        )
        return logp, ent, to_device(sample_ids, torch.long, self.st.device)

    def _set_routing(self, gpt, batch: list[TrainSample]) -> None:
        from vime_core.trainer.routing import check_routed_experts, packed_routing, replay

        a = self.st.arch
        check_routed_experts(batch, a.num_layers, a.moe_topk, a.num_experts)
        replay(gpt, packed_routing(batch).to(self.st.device))

    @torch.no_grad()
    def routing_metrics(self, samples: list[TrainSample]) -> dict[str, float]:
        """R3's measurements on this rank's samples (one no-grad forward without replay): the share of (token, layer)
        top-k sets the trainer's routers choose as vLLM did, and the train/rollout log-prob diff without replay."""
        from vime_core.trainer.routing import agreement, engine_rows, packed_routing, recording

        live = [s for s in samples if s.response_len > 0]
        same = total = 0
        parts = []
        for mb, pad in self.packing([len(s.tokens) for s in live]):
            batch = [live[i] for i in mb]
            with recording(self.st.model) as chosen:
                logp, _, sid = self.forward(self.st.model, batch + pad_samples(pad), with_entropy=False, replay=False)
            if not batch:  # lockstep padding alone (expert parallel): nothing to compare
                continue
            real = sum(len(b.tokens) for b in batch)  # the padding's rows come last
            s, n = agreement(chosen[0][:real], packed_routing(batch), engine_rows(batch))
            same, total = same + s, total + n
            flat_rollout = [x for b in batch for x in (b.rollout_logprobs or [0.0] * b.response_len)]
            rollout = to_device(flat_rollout, torch.float32, logp.device)
            mask = to_device([x for b in batch for x in b.loss_mask], torch.float32, logp.device)
            parts.append(rollout_diff_sums(logp, rollout, mask, sid, batch))
        diffs = per_sample_means(parts)
        same, total, diff_sum, diff_count = self._sum_over_dp_many([same, total, sum(diffs), len(diffs)])
        agree, diff = ROUTING_METRICS
        return {agree: same / total if total else 1.0, diff: diff_sum / diff_count if diff_count else 0.0}

    @torch.no_grad()
    def logprobs(self, model, samples: list[TrainSample]) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(samples)
        with self.st.peaks.phase("logprobs"):
            for mb, pad in self.packing([len(s.tokens) for s in samples]):
                logp, _, sid = self.forward(model, [samples[i] for i in mb] + self.pads(pad), with_entropy=False)
                for j, i in enumerate(mb):
                    out[i] = logp[sid == j].cpu()
                self.st.heartbeat.beat("a no-grad forward")
        return out  # type: ignore[return-value]

    def _logprobs_of_live(self, model, samples: list[TrainSample]) -> list[torch.Tensor]:
        """`_logprobs` of the samples with response tokens; an empty tensor for the others (a micro-batch of empty
        responses alone has nothing to gather)."""
        live = [i for i, s in enumerate(samples) if s.response_len > 0]
        out = [torch.zeros(0) for _ in samples]
        for i, lp in zip(live, self.logprobs(model, [samples[i] for i in live]) if live else []):
            out[i] = lp
        return out

    # -- one rollout step ---------------------------------------------------------------------------------------------
    @train_step_memory
    def train(self, rollout_id: int, steps: list[list[TrainSample]]) -> dict[str, float]:
        """`steps[k]` are this rank's samples of optimizer step k. Returns metrics reduced over data-parallel ranks."""
        t0 = time.perf_counter()
        self.st.model.eval()
        flat = [s for step in steps for s in step]
        routing = self.routing_metrics(flat) if measures_routing(self.st.cfg.rollout, rollout_id) else {}
        # the first optimizer step runs on the weights that are the old policy: its own forward gives its old
        # log-probs; only the later steps' samples need the no-grad pass (all of them with `forward`)
        first = len(steps[0]) if self.st.cfg.train.old_logprobs == "auto" else 0
        old_later = self._logprobs_of_live(self.st.model, flat[first:]) if flat[first:] else []
        old: list[torch.Tensor | None] = [None] * first + old_later
        ref = self._logprobs_of_live(self.st.ref_model, flat) if self.st.ref_model is not None else None
        self.st.model.train()
        offset = 0
        step_metrics, diffs = [], []
        for k, step_samples in enumerate(steps):
            n = len(step_samples)
            step_old = None if k == 0 and first else old[offset : offset + n]
            m, d = self._optimizer_step(step_samples, step_old, ref[offset : offset + n] if ref else None)
            step_metrics.append(m)
            diffs += d
            offset += n
        metrics: dict[str, float] = {}
        for k in step_metrics[0]:
            metrics[k] = _mean([m[k] for m in step_metrics])
        tokens = sum(len(s.tokens) for s in flat)
        metrics = self._reduce_over_dp(metrics)
        # the mean over every DP rank's samples, as at DP = 1: a mean of the ranks' means weighted a rank with fewer
        # counted samples (empty responses) up, -0.86% at DP = 2 on the real trainer (issue 28, N4)
        diff_sum, diff_count = self._sum_over_dp_many([sum(diffs), len(diffs)])
        metrics["train/train_rollout_logprob_abs_diff"] = diff_sum / diff_count if diff_count else 0.0
        metrics.update(routing)
        elapsed = time.perf_counter() - t0
        metrics["perf/actor_train_tok_per_s"] = (
            self._sum_over_dp(tokens) / elapsed / max(1, self.st.world_size // self.st.cfg.train.data_parallel_size)
        )
        return metrics

    def _optimizer_step(
        self,
        samples: list[TrainSample],
        old: list[torch.Tensor] | None,
        ref: list[torch.Tensor] | None,
    ) -> tuple[dict[str, float], list[float]]:
        """One optimizer step over `samples` -> (its train/* metrics, each sample's mean |old - rollout| log-prob over
        its trained tokens). `old` None: the old log-probs are this forward's own (detached). Nothing is read back
        to the host before the last micro-batch's backward is queued (metric sums stay on the device)."""
        g, dp = self.st.cfg.grpo, self.st.cfg.train.data_parallel_size
        trained = sum(sum(s.loss_mask) for s in samples)
        # the denominator of the loss is global over data-parallel ranks: samples, or trained (mask = 1) tokens
        step_tokens = int(self._sum_over_dp(trained)) if g.loss_aggregation == "token_mean" else 0
        denom = step_denominator(g.loss_aggregation, len(samples), step_tokens, dp)
        scale = loss_scale(self.st.optim.kind, dp)  # megatron's DDP averages over DP; the logged loss stays unscaled
        sums, loss_share = dict.fromkeys(METRIC_KEYS, 0.0), 0.0
        diff_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.st.optim.zero_grad()

        # a sample without response tokens adds nothing to the loss (it still counts in sample_mean's denominator)
        live = [i for i, s in enumerate(samples) if s.response_len > 0]
        for mb, pad in self.packing([len(samples[i].tokens) for i in live]):
            idx = [live[j] for j in mb]
            loss, part, diff = self._micro_batch([samples[i] for i in idx] + self.pads(pad), idx, old, ref, denom)
            diff_parts.append(diff)
            (loss * scale).backward()
            self.st.heartbeat.beat("a micro-batch")  # the driver's stall check (train.stall_timeout_s) reads these
            loss_share = loss_share + loss.detach()
            for k in METRIC_KEYS:
                sums[k] = sums[k] + part[k]
        # step totals over DP ranks: exact token means, and the loss as the sum of the ranks' shares (a NaN on any
        # rank makes it NaN on all, so every rank stops together)
        values = host_floats([*(sums[k] for k in METRIC_KEYS), trained, loss_share])
        *totals, all_trained, loss = self._sum_over_dp_many(values)
        lr = lr_at(self.st.step, self.st.cfg)
        t_opt = time.perf_counter()  # host_floats synchronized above: this times the optimizer's own work
        grad_norm = self.st.optim.apply(lr, loss, f"optimizer step {self.st.step}")
        opt_time = time.perf_counter() - t_opt
        self.st.heartbeat.beat("an optimizer step")
        self.st.step += 1
        out = step_train_metrics(dict(zip(METRIC_KEYS, totals)), int(all_trained), loss, g)
        out["perf/optimizer_step_time"] = opt_time
        out["train/grad_norm"] = grad_norm
        out["train/lr"] = lr
        return out, per_sample_means(diff_parts)

    def _micro_batch(self, batch: list[TrainSample], idx: list[int], old, ref, denom: float):
        """One micro-batch's forward and loss -> (loss, its metric parts, its rollout-diff sums); `idx` are the
        samples' places in the step (for `old` / `ref`, each a per-sample list or None), the padding after them."""
        g, dev = self.st.cfg.grpo, self.st.device

        def flat(values: list) -> torch.Tensor:
            return to_device(values, torch.float32, dev)

        logp, ent, sid = self.forward(self.st.model, batch, with_entropy=True)

        def gathered(per_sample: list[torch.Tensor]) -> torch.Tensor:  # in micro-batch order; padding alone: empty
            return torch.cat([per_sample[i] for i in idx]).to(dev) if idx else logp.detach()

        mask = flat([m for s in batch for m in s.loss_mask])
        has_rollout = all(len(s.rollout_logprobs) == s.response_len for s in batch)
        rollout = flat([x for s in batch for x in (s.rollout_logprobs or [0.0] * s.response_len)])
        old_logp = logp.detach() if old is None else gathered(old)
        loss, part = micro_batch_loss(
            MicroBatch(
                logp=logp,
                old_logp=old_logp,
                advantages=flat([s.advantage for s in batch for _ in range(s.response_len)]),
                mask=mask,
                sample_ids=sid,
                num_samples=len(batch),
                entropy=ent,
                ref_logp=gathered(ref) if ref is not None else None,
                rollout_logp=rollout if g.use_tis is True and has_rollout else None,
            ),
            g,
            denom,
        )
        return loss, part, rollout_diff_sums(old_logp, rollout, mask, sid, batch)

    def pads(self, tokens: int) -> list[TrainSample]:
        """The lockstep padding of a micro-batch (`packing`), routed when the routers replay (R3)."""
        a = self.st.arch
        return pad_samples(tokens, (a.num_layers, a.moe_topk) if self.st.cfg.rollout.routing_replay else None)

    def packing(self, lengths: list[int]) -> list[tuple[list[int], int]]:
        """Micro-batches by token budget, each with the tokens of padding it takes (lockstep_pads): at expert
        parallel size > 1 every EP rank runs as many micro-batches as the most any packs, each as long as the longest
        of that place, since the MoE layers exchange their tokens in equal pieces."""
        mbs = pack_micro_batches(lengths, self.st.cfg.train.max_tokens_per_device)
        ps = self.st.ps
        if ps.get_expert_model_parallel_world_size() == 1:
            return [(mb, 0) for mb in mbs]
        sizes = [sum(lengths[i] for i in mb) for mb in mbs]
        group = ps.get_expert_model_parallel_group()
        count = torch.tensor([len(sizes)], dtype=torch.long, device=self.st.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        targets = torch.tensor(sizes + [0] * (int(count) - len(sizes)), dtype=torch.long, device=self.st.device)
        dist.all_reduce(targets, op=dist.ReduceOp.MAX, group=group)
        pads = lockstep_pads(sizes, targets.tolist())
        return [(mbs[j] if j < len(mbs) else [], pad) for j, pad in enumerate(pads)]

    def _reduce_over_dp(self, metrics: dict[str, float]) -> dict[str, float]:
        """Mean over data-parallel ranks (train/* are step totals already, equal on every rank: see _optimizer_step)."""
        dp = self.st.ps.get_data_parallel_world_size()
        if dp == 1:
            return metrics
        keys = sorted(metrics)
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.st.device)
        dist.all_reduce(t, group=self.st.ps.get_data_parallel_group())
        return dict(zip(keys, (t / dp).tolist()))

    def _sum_over_dp_many(self, values: list[float]) -> list[float]:
        if self.st.ps.get_data_parallel_world_size() == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.st.device)
        dist.all_reduce(t, group=self.st.ps.get_data_parallel_group())
        return t.tolist()

    def _sum_over_dp(self, value: float) -> float:
        if self.st.ps.get_data_parallel_world_size() == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.st.device)
        dist.all_reduce(t, group=self.st.ps.get_data_parallel_group())
        return float(t.item())


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def host_floats(values: list) -> list[float]:
    """Floats and 0-dim device tensors -> floats, with one device-to-host copy for all the tensors."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack([t.double() for t in tensors]).tolist() if tensors else [])
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


def rollout_diff_sums(
    logp: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, sample_ids: torch.Tensor, batch: list[TrainSample]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample of a micro-batch, on the device: (sum of |trainer - rollout| log-prob, count) over its trained
    tokens (the policy's: a custom generate masks out e.g. tool output); samples without rollout log-probs count
    no token."""
    has = to_device([float(len(s.rollout_logprobs) == s.response_len) for s in batch], torch.float32, logp.device)
    ok = (mask > 0).float() * has.index_select(0, sample_ids)
    n = len(batch)
    sums = torch.zeros(n, dtype=torch.float32, device=logp.device).index_add_(
        0, sample_ids, (logp - rollout).abs() * ok
    )
    counts = torch.zeros(n, dtype=torch.float32, device=logp.device).index_add_(0, sample_ids, ok)
    return sums, counts


def per_sample_means(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """The per-sample means of rollout_diff_sums' parts (one host read), samples without a counted token left out."""
    if not parts:
        return []
    sums, counts = torch.cat([p[0] for p in parts]).tolist(), torch.cat([p[1] for p in parts]).tolist()
    return [s / c for s, c in zip(sums, counts) if c > 0]
