"""Molt: compact, PyTorch-native agentic RL for LLM policies.

    molt                          # quickstart defaults (conf/config.yaml)
    molt experiment=quickstart dry_run=true
"""
