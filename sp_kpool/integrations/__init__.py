"""Adapters for the frameworks our users run (imported on demand)."""
