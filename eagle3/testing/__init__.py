"""Test and demo support: tiny synthetic checkpoints in the exact upstream formats (:mod:`.tiny`)."""
