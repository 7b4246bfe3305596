"""Mirrors vllm/utils/hashing.py (vllm-project/vllm @ e578de311c2416e66c6a8b9819586bb91de10f9d):
``sha256`` = SHA-256 of the object's pickle (highest protocol), the default
``prefix_caching_hash_algo``."""

import hashlib
import pickle


def sha256(obj):
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
