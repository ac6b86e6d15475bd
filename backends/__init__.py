"""The replicas themselves: handles (state plus breaker), launchers and process groups.

Starts and stops real vLLM or emulated replicas and builds the tiny test model.
"""
