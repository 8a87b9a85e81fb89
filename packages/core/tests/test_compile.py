"""`train.options.compile`: each decoder layer's forward compiled, the same loss and gradients as uncompiled,
compiled code really run (not a silent fall back), and the trainers that cannot compile say so."""

import pytest
import torch

from gearshift.backends.torch_train import TorchTrainEngine
from gearshift.bench.train import train_batch
from gearshift.layers import decoder_layers
from gearshift.train import nll_loss


def _step(engine, batch):
    metrics = engine.train_step(batch, nll_loss)
    return metrics, {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("options", [{}, {"lora_r": 4}, {"gradient_checkpointing": True}])
def test_a_compiled_step_computes_what_the_uncompiled_one_does(gearshift_model, options, tmp_path, monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # compiled here, not read from an earlier run
    torch._dynamo.reset()  # the layer class's graphs, whatever ran before in this process
    counters.clear()
    eager = TorchTrainEngine.build(gearshift_model, lr=1e-2, keep_grads=True, **options)
    compiled = TorchTrainEngine.build(gearshift_model, lr=1e-2, keep_grads=True, compile=True, **options)
    assert all(getattr(layer.forward, "_gearshift_compiled", False) for layer in decoder_layers(compiled.model))
    assert [n for n, _ in compiled.model.named_parameters()] == [n for n, _ in eager.model.named_parameters()]
    batch = train_batch(4, 24, 8)  # rows of several lengths: a padding mask
    (m_eager, g_eager), (m_compiled, g_compiled) = _step(eager, batch), _step(compiled, batch)
    assert counters["stats"]["unique_graphs"] >= 1, "the layers ran compiled code"
    assert m_compiled["loss"] == pytest.approx(m_eager["loss"], rel=1e-6)
    assert m_compiled["grad_norm"] == pytest.approx(m_eager["grad_norm"], rel=1e-5)
    assert g_compiled.keys() == g_eager.keys()
    for name in g_eager:
        torch.testing.assert_close(g_compiled[name], g_eager[name], rtol=1e-4, atol=1e-6, msg=name)
    graphs = counters["stats"]["unique_graphs"]
    _step(compiled, train_batch(6, 40, 10, seed=1))  # another count of rows and width: the same graphs
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_trainer_refuses_compile_where_it_cannot_compile(gearshift_model):
    from gearshift.mesh import MeshSpec
    from gearshift.sharding import Sharding

    class NoLayers(torch.nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(ValueError, match="no decoder layers"):
        Sharding().compile(NoLayers(), MeshSpec())


def test_compile_is_refused_for_a_model_type_whose_compiled_layers_were_not_found_equal(tmp_path):
    """OPT's and Falcon's compiled layers gave other gradients (tools/compile_matrix.py): refused at build, before
    anything is compiled, naming the types that were checked."""
    from gearshift.layers import COMPILE_CHECKED
    from gearshift.models import resolve_model

    assert "qwen2" in COMPILE_CHECKED and not {"opt", "falcon"} & COMPILE_CHECKED
    with pytest.raises(ValueError, match="model type 'falcon' are not checked.*qwen2"):
        TorchTrainEngine.build(resolve_model("tiny-falcon"), compile=True)
