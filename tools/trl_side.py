#!/usr/bin/env python3
"""TRL's GRPOTrainer on a job that tools/trl_compare.py wrote out; run in TRL's own environment.

    .venv-trl/bin/python tools/trl_side.py JOB.json

JOB.json (written by trl_compare.py on the CPU, tools/gpu/trl_h200.py on a GPU) names the model folder, the
prompts in the order gearshift serves them, the reward file and the settings. gearshift itself is not imported:
the reward is gearshift's own `numeric_match`, loaded from its source file, which needs nothing but the standard
library. Each step's end time, mean reward and mean completion length go to the job's `trl_steps` file, one JSON
line a step.

A job with a `trl` section (the GPU's) also sets TRL's own knobs: vLLM generation (`use_vllm`, colocated in
the trainer's process), bf16, the micro-batch (per_device_train_batch_size, with gradient accumulation making
up one optimizer step of the whole batch), gradient checkpointing and vLLM's memory share and sleep mode.
Without one (the CPU's), TRL trains the whole batch at once in fp32 on the CPU with its own generate().
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


def grpo_args(job: dict) -> dict:
    """GRPOConfig's keyword arguments for `job` (needs no TRL: tests check the mapping)."""
    s, t = job["settings"], job.get("trl") or {}
    batch = s["prompts"] * s["n"]
    micro = int(t.get("micro_batch") or batch)
    if batch % micro:
        raise ValueError(f"the micro-batch {micro} does not divide the batch of {batch} samples")
    gpu = job.get("device", "cpu") != "cpu"
    args = dict(
        output_dir=job["trl_dir"], use_cpu=not gpu, seed=job["seed"], data_seed=job["seed"],
        max_steps=job["steps"], per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        num_generations=s["n"], max_completion_length=s["max_tokens"], temperature=s["temperature"],
        top_p=1.0, top_k=0, learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=s["weight_decay"], adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        max_grad_norm=s["max_grad_norm"], beta=0.0, epsilon=s["clip"], loss_type="dapo", scale_rewards="group",
        num_iterations=1, shuffle_dataset=False, disable_dropout=True, logging_steps=1, report_to=[],
        save_strategy="no", dataloader_num_workers=0, bf16=bool(t.get("bf16", False)), fp16=False,
        # GRPOConfig turns recomputation on by default; gearshift's trainers keep activations unless told
        gradient_checkpointing=bool(t.get("gradient_checkpointing", job.get("gradient_checkpointing", True))),
        entropy_coef=float(s.get("entropy_coef", 0.0)),
    )
    if t.get("use_vllm"):
        args.update(use_vllm=True, vllm_mode="colocate",
                    vllm_gpu_memory_utilization=float(t.get("vllm_gpu_memory_utilization", 0.3)),
                    vllm_enable_sleep_mode=bool(t.get("vllm_enable_sleep_mode", False)),
                    vllm_max_model_length=t.get("vllm_max_model_length"),
                    # no separate pass for the old logprobs, as gearshift's `rollout_correction=none`
                    vllm_importance_sampling_correction=bool(t.get("importance_sampling", False)))
    return args


def main() -> int:
    job = json.load(open(sys.argv[1]))
    import torch

    if job.get("threads"):
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
    dtype = getattr(torch, (job.get("trl") or {}).get("model_dtype", "float32"))
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=dtype)
    args = GRPOConfig(**grpo_args(job))
    log = open(job["trl_steps"], "w")

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            self.end = time.time()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                log.write(json.dumps({"step": state.global_step, "end": getattr(self, "end", time.time()),
                                      "reward": logs["reward"],
                                      "length": logs.get("completions/mean_length")}) + "\n")
                log.flush()

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[Steps()])
    print(f"trl: start {time.time():.3f}", flush=True)
    trainer.train()
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
