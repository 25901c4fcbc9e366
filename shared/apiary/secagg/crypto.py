"""The protocol's cryptography, all from the `cryptography` package: X25519 key pairs and agreement, HKDF-SHA256
to derive keys bound to the round, AES-256-GCM for the shares in transit, Ed25519 signatures on public keys."""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32
NONCE_BYTES = 12
RAW = serialization.Encoding.Raw, serialization.PublicFormat.Raw
PRIVATE_RAW = serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()


class CryptoError(ValueError):
    """A signature that does not verify, a ciphertext that does not decrypt, a malformed key."""


def new_private_key() -> bytes:
    """A fresh X25519 private key (32 raw bytes)."""
    return X25519PrivateKey.generate().private_bytes(*PRIVATE_RAW)


def public_key(private: bytes) -> bytes:
    """The X25519 public key (32 raw bytes) of a private key."""
    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes(*RAW)


def agree(private: bytes, peer_public: bytes, purpose: bytes, context: bytes) -> bytes:
    """A 32-byte key both ends derive alike: X25519, then HKDF-SHA256 over what it is for and the round."""
    try:
        shared = X25519PrivateKey.from_private_bytes(private).exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as e:
        raise CryptoError(f"key agreement failed: {e}") from None
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=purpose + b"|" + context).derive(shared)


def encrypt(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """AES-256-GCM: a random nonce, then the ciphertext and tag; `associated` is authenticated, not sent."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def decrypt(key: bytes, ciphertext: bytes, associated: bytes) -> bytes:
    """The plaintext of `encrypt`'s output; CryptoError if it was altered or is for another sender or round."""
    try:
        return AESGCM(key).decrypt(ciphertext[:NONCE_BYTES], ciphertext[NONCE_BYTES:], associated)
    except (InvalidTag, ValueError):
        raise CryptoError("a share does not decrypt (altered, or not for this worker and round)") from None


def new_signing_key() -> bytes:
    """A fresh Ed25519 private key (32 raw bytes)."""
    return Ed25519PrivateKey.generate().private_bytes(*PRIVATE_RAW)


def verify_key(signing_key: bytes) -> bytes:
    """The Ed25519 public key (32 raw bytes) of a signing key."""
    return Ed25519PrivateKey.from_private_bytes(signing_key).public_key().public_bytes(*RAW)


def sign(signing_key: bytes, message: bytes) -> bytes:
    """An Ed25519 signature."""
    return Ed25519PrivateKey.from_private_bytes(signing_key).sign(message)


def verify(verify_key_bytes: bytes, signature: bytes, message: bytes) -> None:
    """Nothing if `signature` is the key's on `message`, else CryptoError."""
    try:
        Ed25519PublicKey.from_public_bytes(verify_key_bytes).verify(signature, message)
    except (InvalidSignature, ValueError):
        raise CryptoError("a signature does not verify") from None


def signing_key_from_secret(secret: str, context: bytes) -> bytes:
    """The Ed25519 signing key (32 raw bytes) a shard's worker signs its protocol keys with: HKDF-SHA256 of its
    assignment's one-time secret, which only the scheduler and that assignment hold, for this round."""
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                info=b"apiary secagg signing|" + context).derive(secret.encode())


def round_context(job_id: str, round_index: int, attempt: int) -> bytes:
    """What binds the protocol's keys, signatures and masks to one attempt of one round of one job."""
    return f"{job_id}/{round_index}/{attempt}".encode()


def verify_keys_of(secrets: dict[int, str], context: bytes) -> dict[int, str]:
    """Each shard's verify key (hex), from its assignment's secret: what round.start and the assignments carry."""
    return {shard: verify_key(signing_key_from_secret(secret, context)).hex() for shard, secret in secrets.items()}
