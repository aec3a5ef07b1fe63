"""draft package."""
