"""RL fine-tuning core: algorithms, models, engines, rewards and stage programs.

This package never imports prefect, so every stage can run in another environment
(``python -m rft_core.stages``) and shards can be replayed without a server.
"""
