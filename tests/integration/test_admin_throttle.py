"""Login throttling: per account, per client and per pair, stored in PostgreSQL (so it
holds across processes), answered with 429 and Retry-After, and a bound on concurrent
password hashing."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
import pytest
from falcon import testing
from psycopg import sql

from admin_api import accounts as accounts_module
from admin_api import create_app
from admin_api.accounts import AccountStore, HashingBusy
from admin_api.throttle import ACCOUNT, CLIENT, PAIR, LoginThrottle

from .admin_support import CSRF, PASSWORD, AdminEnv


@pytest.fixture(scope="module")
def admin_settings():
    return dict(trusted_proxies=("10.0.0.1",))


def new_user(env) -> str:
    address = f"t{uuid.uuid4().hex[:10]}@example.com"
    env.accounts.create_user(address, PASSWORD, "viewer")
    return address


def new_client() -> str:
    return f"192.0.2.{uuid.uuid4().int % 250 + 1}-{uuid.uuid4().hex[:4]}"


def login(client, email, password=PASSWORD, addr="198.51.100.7", headers=None):
    return client.simulate_post(
        "/api/auth/login",
        json={"email": email, "password": password},
        headers={**CSRF, **(headers or {})},
        remote_addr=addr,
    )


def lengthen_block(env, email: str, client: str) -> None:
    """More failures for the pair, so that its block outlasts a slow test (the first block
    is one second)."""
    throttle = LoginThrottle(env.pool, env.settings.schema)
    for _ in range(8):
        throttle.failed(email, client)


def test_one_client_guessing_one_account_is_blocked_with_retry_after(env, pg_url, schema):
    email, addr = new_user(env), new_client()
    for _ in range(PAIR.free):
        assert login(env.client, email, "wrong password", addr).status_code == 401
    blocked = login(env.client, email, "wrong password", addr)
    assert blocked.status_code == 401 and int(blocked.headers["retry-after"]) >= 1
    lengthen_block(env, email, addr)
    # Now even the right password is refused without a check, with 429 and Retry-After.
    refused = login(env.client, email, PASSWORD, addr)
    assert refused.status_code == 429, refused.text
    assert refused.json["error"] == "too_many_requests"
    assert 1 <= int(refused.headers["retry-after"]) <= PAIR.max_block

    # Another process (another gunicorn worker, another host) sees the same block.
    other = AdminEnv(pg_url, schema)
    try:
        assert login(other.client, email, PASSWORD, addr).status_code == 429
    finally:
        other.close()

    # The same account from another address still logs in.
    assert login(env.client, email, PASSWORD, new_client()).status_code == 200

    # Once the block is over, the right password works again.
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("UPDATE {}.login_throttle SET blocked_until = now() - interval '1 s'").format(
                sql.Identifier(schema)
            )
        )
    assert login(env.client, email, PASSWORD, addr).status_code == 200


def test_one_client_trying_many_accounts_is_blocked(env):
    addr = new_client()
    for n in range(CLIENT.free + 1):
        result = login(env.client, f"nobody{n}-{uuid.uuid4().hex[:6]}@example.com", "x" * 8, addr)
        assert result.status_code == 401, (n, result.text)
    assert int(result.headers["retry-after"]) >= 1
    lengthen_block(env, "nobody@example.com", addr)  # the client key grows too
    result = login(env.client, new_user(env), PASSWORD, addr)
    assert result.status_code == 429
    assert int(result.headers["retry-after"]) >= 1


def test_many_clients_cannot_lock_a_real_user_out_for_long(env):
    email = new_user(env)
    throttle = LoginThrottle(env.pool, env.settings.schema)
    waits = [throttle.failed(email, new_client()) for _ in range(ACCOUNT.free + 30)]
    assert waits[ACCOUNT.free - 1] == 0 and waits[ACCOUNT.free] >= 1
    # The account-wide block grows, but never past a minute.
    assert max(waits) <= ACCOUNT.max_block == 60
    wait = throttle.retry_after(email, new_client())
    assert 1 <= wait <= 60
    result = login(env.client, email, PASSWORD, new_client())
    assert result.status_code == 429 and int(result.headers["retry-after"]) <= 60


def test_the_client_address_comes_from_a_trusted_proxy_only(env):
    email = new_user(env)
    spoofed = new_client()
    # From an untrusted peer, X-Forwarded-For is ignored: the peer is the client.
    peer = new_client()
    for _ in range(PAIR.free + 1):
        login(env.client, email, "wrong password", peer, headers={"X-Forwarded-For": spoofed})
    lengthen_block(env, email, peer)
    assert login(env.client, email, PASSWORD, peer).status_code == 429
    assert login(env.client, email, PASSWORD, spoofed).status_code == 200
    # From the trusted proxy, the forwarded address is the client.
    email = new_user(env)
    client = new_client()
    forwarded = {"X-Forwarded-For": f"6.6.6.6, {client}"}
    for _ in range(PAIR.free + 1):
        login(env.client, email, "wrong password", "10.0.0.1", headers=forwarded)
    lengthen_block(env, email, client)
    assert login(env.client, email, PASSWORD, "10.0.0.1", headers=forwarded).status_code == 429
    other = {"X-Forwarded-For": new_client()}
    assert login(env.client, email, PASSWORD, "10.0.0.1", headers=other).status_code == 200


def test_password_hashing_is_bounded(env, monkeypatch):
    store = AccountStore(env.pool, env.settings.schema, bcrypt_rounds=4, hash_concurrency=1)
    email = new_user(env)
    real = accounts_module.bcrypt.checkpw
    running = []
    peak = []
    lock = threading.Lock()

    def slow_checkpw(password, hashed):
        with lock:
            running.append(1)
            peak.append(len(running))
        time.sleep(0.1)
        with lock:
            running.pop()
        return real(password, hashed)

    monkeypatch.setattr(accounts_module.bcrypt, "checkpw", slow_checkpw)
    results = []
    barrier = threading.Barrier(6)

    def attempt():
        barrier.wait(10)
        try:
            results.append(store.authenticate(email, PASSWORD) is not None)
        except HashingBusy:
            results.append("busy")

    threads = [threading.Thread(target=attempt) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 6
    assert max(peak) == 1, peak
    assert results.count(True) >= 1

    # Past the wait, the API answers 429 with Retry-After.
    monkeypatch.setattr(accounts_module, "HASH_WAIT_SECONDS", 0.01)
    app = create_app(env.settings, store=env.store, accounts=store, engine=env.engine)
    client = testing.TestClient(app)
    store.hash_slots.acquire()
    try:
        busy = login(client, email, PASSWORD, new_client())
    finally:
        store.hash_slots.release()
    assert busy.status_code == 429, busy.text
    assert busy.headers["retry-after"] == "1"
