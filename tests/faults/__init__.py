"""Deliberately faulty components, installed like third-party plugins, to prove the correctness oracles fail."""
