"""Speculative decoding: n-gram (prompt lookup) proposals and their exact verification."""
