"""The model zoo apart from the engine: known models and their installation (registry), the distilled hybrid
(hybrid), loading a checkpoint with its adapter (loader)."""
