"""Offline tools for speculative decoding: ``train_eagle`` distills an EAGLE-1 head for a target."""
