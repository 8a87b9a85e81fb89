"""gearshift-deepspeed: package of the DeepSpeed ZeRO train backend (no engine registered yet)."""
