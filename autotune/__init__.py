"""autotune package."""
