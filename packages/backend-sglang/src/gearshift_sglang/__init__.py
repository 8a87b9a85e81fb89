"""gearshift-sglang: package of the SGLang rollout backend (no engine registered yet)."""
