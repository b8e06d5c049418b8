"""Inference servers in the loop: rollouts and teacher log-probabilities from an OpenAI-compatible server (vLLM),
with the student's weights synced into the server and verified."""
