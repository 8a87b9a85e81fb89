#!/usr/bin/env python3
"""TRL's GRPOTrainer on a job that tools/trl_compare.py wrote out; run in TRL's own environment.

    .venv-trl/bin/python tools/trl_side.py JOB.json

JOB.json (written by trl_compare.py) names the model folder, the prompts in the order gearshift serves them,
the reward file and the settings. gearshift itself is not imported: the reward is gearshift's own
`numeric_match`, loaded from its source file, which needs nothing but the standard library. Each step's end
time and mean reward go to the job's `trl_steps` file, one JSON line a step.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time


def load_reward(path: str, name: str):
    spec = importlib.util.spec_from_file_location("gearshift_rewards_file", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and the like look the module up by name
    spec.loader.exec_module(module)
    return getattr(module, name)


def main() -> int:
    job = json.load(open(sys.argv[1]))
    import torch

    torch.set_num_threads(job["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in open(job["prompts"])]
    rule = load_reward(job["reward_file"], job["reward_name"])

    def reward(completions, answer, **_):
        return [float(rule(c, a)) for c, a in zip(completions, answer)]

    reward.__name__ = job["reward_name"]
    tokenizer = AutoTokenizer.from_pretrained(job["model"], padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    s = job["settings"]
    args = GRPOConfig(
        output_dir=job["trl_dir"], use_cpu=True, seed=job["seed"], data_seed=job["seed"],
        max_steps=job["steps"], per_device_train_batch_size=s["prompts"] * s["n"], gradient_accumulation_steps=1,
        num_generations=s["n"], max_completion_length=s["max_tokens"], temperature=s["temperature"],
        top_p=1.0, top_k=0, learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=s["weight_decay"], adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        max_grad_norm=s["max_grad_norm"], beta=0.0, epsilon=s["clip"], loss_type="dapo", scale_rewards="group",
        num_iterations=1, shuffle_dataset=False, disable_dropout=True, logging_steps=1, report_to=[],
        save_strategy="no", dataloader_num_workers=0, bf16=False, fp16=False,
    )
    log = open(job["trl_steps"], "w")

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            self.end = time.time()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                log.write(json.dumps({"step": state.global_step, "end": getattr(self, "end", time.time()),
                                      "reward": logs["reward"]}) + "\n")
                log.flush()

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[Steps()])
    print(f"trl: start {time.time():.3f}", flush=True)
    trainer.train()
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
