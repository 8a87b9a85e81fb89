"""Contracts of a `TrainEngine`.

Fixture to supply: `train_engine_factory`, a callable `(**options) -> TrainEngine`
building a fresh fp32 engine from `gearshift_model` (tests change weights, so
each builds its own). Under torchrun every rank runs the same tests in step.
Set `train_backend` to the engine's class: its `conformance_xfail["train"]`
marks the tests it is known to fail where it runs.
"""

from __future__ import annotations

import gc

import pytest
import torch

from .. import dist as gdist
from ..reshard import export_weights
from ..train import TrainBatch, nll_loss
from .util import PROMPTS, reference_weights, tolerances

RESPONSES = [[10, 20, 30, 40, 50], [60, 70, 80], [90, 100, 110, 120]]


def fixed_batch() -> TrainBatch:
    return TrainBatch.from_sequences(PROMPTS, RESPONSES, pad_id=0)


nll = nll_loss  # the loss the suite trains with


def full_weights(engine) -> dict[str, torch.Tensor]:
    out = {}
    for bucket in export_weights(engine):
        out.update((k, v.detach().cpu().clone()) for k, v in bucket.items())
    return out


def assert_same(a: dict, b: dict, exact: bool = True) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), f"{k} differs (max {float((a[k] - b[k]).abs().max()):.3g})"
        else:
            torch.testing.assert_close(a[k], b[k], msg=k)


class TrainEngineSuite:
    """Subclass in a test module and supply `train_engine_factory`."""

    train_backend: type | None = None
    logprob_atol: float = 1e-5
    lr: float = 1e-2

    @pytest.fixture
    def train_engine_factory(self):
        raise NotImplementedError(
            f"{type(self).__name__} must supply the fixture train_engine_factory: a callable (**options) -> a "
            f"fresh float32 engine built from gearshift_model, e.g.\n"
            f"    @pytest.fixture\n    def train_engine_factory(self, gearshift_model):\n"
            f"        return lambda **kw: MyTrainer.build(gearshift_model, **kw)")

    @pytest.fixture
    def new_train_engine(self, train_engine_factory):
        """`train_engine_factory`, with every engine a test builds closed when the test ends.

        An engine the test merely drops may never be collected (ZeRO-3 keeps its model on a module-level
        stack), so without `close` each test's engine would stay on the device beside the next one's.
        """
        built = []

        def build(**options):
            engine = train_engine_factory(**options)
            built.append(engine)
            return engine

        yield build
        for engine in built:
            engine.close()
        del built[:]
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @staticmethod
    def _gap_to_transformers(got: torch.Tensor, batch: TrainBatch, model_path: str) -> float:
        """The largest gap between `got` and each row's logprobs from transformers, the row run alone."""
        from transformers import AutoModelForCausalLM

        ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        with torch.no_grad():
            rows = []
            for i in range(batch.size):
                n = int(batch.attention_mask[i].sum())
                logits = ref_model(batch.input_ids[i:i + 1, :n]).logits[0, :-1]
                rows.append(torch.log_softmax(logits.float(), -1).gather(-1, batch.input_ids[i, 1:n, None]).squeeze(-1))
        return max(float((got[i, 1:len(r) + 1].cpu() - r).abs().max()) for i, r in enumerate(rows))

    def test_forward_logprobs_match_transformers(self, new_train_engine, gearshift_model):
        engine = new_train_engine(lr=self.lr)
        batch = fixed_batch()
        got = engine.forward_logprobs(batch, with_entropy=True)
        diff = self._gap_to_transformers(got.logprobs, batch, gearshift_model)
        print(f"forward_logprobs vs transformers: max abs diff {diff:.3g}")
        assert diff <= max(self.logprob_atol, tolerances(engine)[0])
        assert got.logprobs.shape == batch.input_ids.shape and got.entropy.shape == batch.input_ids.shape

    def test_rows_of_one_prompt_get_the_logprobs_each_gets_alone(self, new_train_engine, gearshift_model):
        """GRPO's batches: n answers to each prompt. An engine that computes a shared prompt once
        (gearshift.shared_prefix) must give each row what it gives the row alone."""
        engine = new_train_engine(lr=self.lr)
        prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 2
        answers = [RESPONSES[0], RESPONSES[1], RESPONSES[2], RESPONSES[2], RESPONSES[0][:1]]
        batch = TrainBatch.from_sequences(prompts, answers, pad_id=0)
        diff = self._gap_to_transformers(engine.forward_logprobs(batch).logprobs, batch, gearshift_model)
        print(f"rows of one prompt vs transformers row by row: max abs diff {diff:.3g}")
        assert diff <= max(self.logprob_atol, tolerances(engine)[0])

    def test_train_step_lowers_loss(self, new_train_engine):
        engine = new_train_engine(lr=self.lr)
        batch = fixed_batch()
        losses = [engine.train_step(batch, nll)["loss"] for _ in range(5)]
        assert all(l == l for l in losses), losses  # no NaN
        # the best loss after stepping, not the last: a large model at the suite's lr may overshoot once
        assert min(losses[1:]) < losses[0] - 0.1, losses

    def test_train_step_returns_loss_grad_norm_and_lr_the_same_on_every_rank(self, new_train_engine):
        engine = new_train_engine(lr=self.lr, micro_batch_size=2)
        metrics = engine.train_step(fixed_batch(), nll)
        for key in ("loss", "grad_norm", "lr", "entropy"):  # entropy: the loss function's own metric
            assert isinstance(metrics.get(key), float), f"train_step must return a float {key!r}: {metrics}"
        assert metrics["lr"] == pytest.approx(self.lr) and metrics["grad_norm"] > 0
        whole = new_train_engine(lr=self.lr).train_step(fixed_batch(), nll)
        rtol = tolerances(engine)[1]  # other batch shapes round differently below float32
        assert metrics["loss"] == pytest.approx(whole["loss"], rel=rtol), "micro-batching changed the loss"
        if gdist.is_distributed():
            import torch.distributed as dist

            everyone = [None] * gdist.world_size()
            dist.all_gather_object(everyone, metrics)
            assert all(m == metrics for m in everyone), f"ranks returned different metrics: {everyone}"

    def test_exported_weights_equal_the_model(self, new_train_engine, gearshift_model):
        engine = new_train_engine(lr=self.lr)
        spec = engine.weight_spec()
        start = full_weights(engine)
        assert_same(start, reference_weights(gearshift_model, spec.replicated()))
        engine.train_step(fixed_batch(), nll)
        after = full_weights(engine)
        assert any(not torch.equal(start[k], after[k]) for k in start), "a train step changed no weight"
        small = list(export_weights(engine, bucket_bytes=max(p.nbytes for p in spec)))
        assert len(small) > 1, "a small bucket size must split the export into several buckets"
        streamed = {k: v.cpu() for b in small for k, v in b.items()}
        assert_same(streamed, after)

    def test_offload_onload_round_trip_is_bit_exact(self, new_train_engine):
        a, b = new_train_engine(lr=self.lr), new_train_engine(lr=self.lr)
        batch = fixed_batch()
        a.train_step(batch, nll)
        b.train_step(batch, nll)
        a.offload(["params", "grads", "optimizer"])
        a.onload(["params", "grads", "optimizer"])
        assert_same(full_weights(a), full_weights(b))
        a.train_step(batch, nll)  # optimizer state must have come back exactly too
        b.train_step(batch, nll)
        assert_same(full_weights(a), full_weights(b))

    def test_save_load_round_trip(self, new_train_engine, gearshift_shared_tmp):
        engine = new_train_engine(lr=self.lr)
        batch = fixed_batch()
        engine.train_step(batch, nll)
        engine.save(str(gearshift_shared_tmp / "ckpt"))
        saved = full_weights(engine)
        next_ref = engine.train_step(batch, nll)["loss"]
        engine.train_step(batch, nll)
        engine.load(str(gearshift_shared_tmp / "ckpt"))
        assert_same(full_weights(engine), saved)
        assert engine.train_step(batch, nll)["loss"] == pytest.approx(next_ref, rel=1e-5)

    def test_save_hf_loads_with_transformers(self, new_train_engine, gearshift_shared_tmp):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        engine = new_train_engine(lr=self.lr)
        engine.train_step(fixed_batch(), nll)
        path = gearshift_shared_tmp / "hf"
        engine.save_hf(str(path))
        loaded = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        AutoTokenizer.from_pretrained(str(path))
        mine = full_weights(engine)
        theirs = dict(loaded.named_parameters())
        assert_same(mine, {k: theirs[k].detach() for k in mine})

    def test_bad_input_is_a_clear_error(self, new_train_engine):
        engine = new_train_engine(lr=self.lr)
        with pytest.raises(ValueError, match="unknown tags"):
            engine.offload(["no_such_tag"])
        with pytest.raises(ValueError, match="shape"):
            TrainBatch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4), torch.ones(2, 3))
        assert engine.forward_logprobs(fixed_batch()).logprobs.isfinite().all()
