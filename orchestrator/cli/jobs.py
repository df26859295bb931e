"""Queue commands."""
