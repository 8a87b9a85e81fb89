"""The sglang backend's tests: a package, so its engine fixture closes after its last test."""
