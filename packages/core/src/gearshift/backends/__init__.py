"""Reference backends shipped with the core: rollout `hf`, train `torch`."""
