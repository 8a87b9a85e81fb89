"""PPO: the critic's values are aligned like logprobs, and PPO with its defaults learns the built-in task."""

import torch

from gearshift.backends.torch_train import TorchTrainEngine
from gearshift.train import TrainBatch


def test_the_value_of_a_token_is_the_value_of_the_prefix_before_it(gearshift_model):
    engine = TorchTrainEngine.build(gearshift_model, value_head=True)
    with torch.no_grad():  # the head starts at zero; any other head shows what each value has seen
        torch.nn.init.normal_(engine.model.value_head.weight)
    prompt, response = [40, 41, 42], [50, 51, 52]
    changed = [50, 77, 52]  # the response's second token, at position 4
    values = [engine.forward_logprobs(TrainBatch.from_sequences([prompt], [r])).values[0]
              for r in (response, changed)]
    # values[:, t] is the value of the state in which token t is chosen: it cannot depend on token t
    torch.testing.assert_close(values[0][:5], values[1][:5], rtol=0, atol=0)
    assert (values[0][5:] - values[1][5:]).abs().min() > 0
    assert values[0][0] == 0 and values[0][1] != 0


def test_critic_warmup_trains_the_critic_alone_first(gearshift_model, tmp_path):
    from gearshift import Trainer

    def longer_is_better(completion):
        return len(completion) / 3

    trainer = Trainer(model=gearshift_model, reward=longer_is_better,
                      algorithm={"name": "ppo", "critic_warmup": 1},
                      rollout={"n": 2, "max_tokens": 3, "backend": "hf"}, train={"backend": "torch"},
                      run={"steps": 2, "prompts_per_step": 4, "output_dir": str(tmp_path), "checkpoint_every": 0,
                           "progress": False, "samples_per_step": 0, "tensorboard": False, "plot": False,
                           "resume": "never"})
    history = trainer.train()
    assert "train/critic/vf_loss" in history[0] and "train/pg_loss" not in history[0]
    assert "train/critic/vf_loss" in history[1] and "train/pg_loss" in history[1]

