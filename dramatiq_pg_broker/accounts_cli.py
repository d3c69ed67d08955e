"""CLI commands for admin API accounts: the first admin, more users, and API tokens.

Commands:
  user create --email EMAIL --role ROLE (--password PASSWORD | --password-stdin) [--exists-ok]
  user list
  token create --email EMAIL --name NAME     prints the token once; only its hash is kept
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from .accounts import ROLES, AccountStore, EmailTaken
from .cli import command_group, settings_from
from .db import ProcessPool


@contextmanager
def account_store(args: argparse.Namespace) -> Iterator[AccountStore]:
    """An account store for one command; its pool is closed afterwards. (A schema without
    the account tables surfaces as ``SchemaMissing``, which says to migrate.)"""
    settings = settings_from(args)
    pool = ProcessPool(settings)
    try:
        yield AccountStore(pool, settings.schema)
    finally:
        pool.close()


def _password(args: argparse.Namespace) -> str:
    if args.password_stdin:
        # One line; the newline a shell pipe or here-string adds is not part of it.
        return sys.stdin.readline().rstrip("\r\n")
    return args.password


def run_user_create(args: argparse.Namespace) -> int:
    password = _password(args)
    with account_store(args) as store:
        if args.exists_ok:
            existing = store.find_user(args.email)
            if existing is not None:
                print(f"user {existing.email} already exists (role {existing.role}); unchanged")
                return 0
        try:
            user = store.create_user(args.email, password, args.role)
        except EmailTaken:
            if not args.exists_ok:
                raise
            print(f"user {args.email} already exists; unchanged")
            return 0
    print(f"created user {user.email} (id {user.id}, role {user.role})")
    return 0


def run_user_list(args: argparse.Namespace) -> int:
    with account_store(args) as store:
        users = store.list_users()
    if not users:
        print("no users yet: create one with `dramatiq-pg-broker user create`")
        return 0
    print(f"{'id':<6}{'email':<40}{'role':<10}{'active':<8}created")
    for user in users:
        created = user.created_at.isoformat(timespec="seconds")
        active = "yes" if user.active else "no"
        print(f"{user.id:<6}{user.email:<40}{user.role:<10}{active:<8}{created}")
    return 0


def run_token_create(args: argparse.Namespace) -> int:
    with account_store(args) as store:
        user = store.find_user(args.email)
        if user is None:
            print(f"error: no user with email {args.email}", file=sys.stderr)
            return 2
        new = store.create_token(user.id, args.name)
    print(
        f"# token {new.token.id} ({new.token.name!r}) for {user.email}; it is shown only this once",
        file=sys.stderr,
    )
    print(new.secret)
    return 0


@command_group
def _account_commands(sub: argparse._SubParsersAction) -> None:
    user = sub.add_parser("user", help="admin API users")
    user_sub = user.add_subparsers(dest="user_command", required=True)

    create = user_sub.add_parser("create", help="create a user")
    create.add_argument("--email", required=True)
    create.add_argument("--role", required=True, choices=ROLES)
    password = create.add_mutually_exclusive_group(required=True)
    password.add_argument("--password", help="the password (visible in the process list)")
    password.add_argument(
        "--password-stdin", action="store_true", help="read the password from standard input"
    )
    create.add_argument(
        "--exists-ok", action="store_true", help="succeed without change if the user exists"
    )
    create.set_defaults(func=run_user_create)

    user_sub.add_parser("list", help="list users").set_defaults(func=run_user_list)

    token = sub.add_parser("token", help="admin API tokens")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    token_create = token_sub.add_parser("create", help="create an API token and print it once")
    token_create.add_argument("--email", required=True, help="the user the token acts as")
    token_create.add_argument("--name", required=True, help="what the token is for")
    token_create.set_defaults(func=run_token_create)
