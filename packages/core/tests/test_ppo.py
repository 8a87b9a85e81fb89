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


def test_critic_epochs_pass_the_critic_over_each_batch_more_often(gearshift_model, tmp_path, monkeypatch):
    from gearshift import Trainer

    updates = {"policy": 0, "critic": 0}
    train_step = TorchTrainEngine.train_step

    def counted(self, batch, loss_fn):
        updates["critic" if self.args.value_head else "policy"] += 1
        return train_step(self, batch, loss_fn)

    monkeypatch.setattr(TorchTrainEngine, "train_step", counted)
    trainer = Trainer(model=gearshift_model, reward=lambda completion: len(completion) / 3,
                      algorithm={"name": "ppo", "critic_epochs": 3},
                      rollout={"n": 2, "max_tokens": 3, "backend": "hf"},
                      train={"backend": "torch", "mini_batch_size": 4},
                      run={"steps": 2, "prompts_per_step": 4, "output_dir": str(tmp_path), "checkpoint_every": 0,
                           "progress": False, "samples_per_step": 0, "tensorboard": False, "plot": False,
                           "resume": "never"})
    history = trainer.train()
    # 8 samples a step in mini-batches of 4: the policy updates twice a step, the critic three times as often
    assert updates == {"policy": 4, "critic": 12}
    assert all(-10 < h["critic/explained_var"] <= 1 for h in history)
