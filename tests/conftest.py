import os

# Must run before jax is imported anywhere: several CPU devices for the sharded-cache tests.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=16")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
