"""Process groups and expert-parallel token exchange."""
