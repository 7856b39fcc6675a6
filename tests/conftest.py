"""Suite-wide settings: deterministic hypothesis profile."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "meshd",
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("meshd")
