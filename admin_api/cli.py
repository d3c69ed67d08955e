"""CLI commands for admin API accounts: users and API tokens.

The ``admin`` extra adds them to ``dramatiq-pg-broker`` (:func:`add_user_commands` and
:func:`add_token_commands`, entry points of the group ``dramatiq_pg_broker.commands`` in
setup.cfg; the broker never imports this module):

  user create --email EMAIL --role ROLE (--password PASSWORD | --password-stdin) [--exists-ok]
  user list
  user deactivate --email EMAIL          ends the user's sessions and revokes their tokens
  user activate --email EMAIL            tokens revoked on deactivation stay revoked
  user set-password --email EMAIL (--password PASSWORD | --password-stdin)
                                         a password reset: ends sessions, revokes tokens
  token create --email EMAIL --name NAME prints the token once; only its hash is kept
  token list --email EMAIL               the user's tokens (never their values)
  token revoke --id ID                   revoke one token for good

Every command takes ``--json`` (as every ``dramatiq-pg-broker`` command does): it prints
the user or token (``token create``: with its ``secret``, shown once) as JSON.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from dramatiq_pg_broker.cli import settings_from
from dramatiq_pg_broker.cli.jobs import to_json
from dramatiq_pg_broker.db import ProcessPool

from .accounts import ROLES, AccountStore, EmailTaken, User, UserNotFound


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


def _user(store: AccountStore, email: str) -> User:
    user = store.find_user(email)
    if user is None:
        raise UserNotFound(f"no user with email {email}")
    return user


def run_user_create(args: argparse.Namespace) -> int:
    password = _password(args)
    with account_store(args) as store:
        if args.exists_ok:
            existing = store.find_user(args.email)
            if existing is not None:
                return said(
                    args,
                    {**existing.as_dict(), "created": False},
                    f"user {existing.email} already exists (role {existing.role}); unchanged",
                )
        try:
            user = store.create_user(args.email, password, args.role)
        except EmailTaken:
            if not args.exists_ok:
                raise
            existing = store.find_user(args.email)
            return said(
                args,
                {**(existing.as_dict() if existing else {"email": args.email}), "created": False},
                f"user {args.email} already exists; unchanged",
            )
    return said(
        args,
        {**user.as_dict(), "created": True},
        f"created user {user.email} (id {user.id}, role {user.role})",
    )


def said(args: argparse.Namespace, data, text: str) -> int:
    """Print ``data`` as JSON with ``--json``, else ``text``; exit 0."""
    print(to_json(data) if args.json else text)
    return 0


def run_user_list(args: argparse.Namespace) -> int:
    with account_store(args) as store:
        users = store.list_users()
    if args.json:
        return said(args, [user.as_dict() for user in users], "")
    if not users:
        print("no users yet: create one with `dramatiq-pg-broker user create`")
        return 0
    print(f"{'id':<6}{'email':<40}{'role':<10}{'active':<8}created")
    for user in users:
        created = user.created_at.isoformat(timespec="seconds")
        active = "yes" if user.active else "no"
        print(f"{user.id:<6}{user.email:<40}{user.role:<10}{active:<8}{created}")
    return 0


def run_user_active(args: argparse.Namespace) -> int:
    with account_store(args) as store:
        user = store.update_user(_user(store, args.email).id, active=args.active)
    if args.active:
        text = f"activated user {user.email}; tokens revoked earlier stay revoked"
    else:
        text = f"deactivated user {user.email}: their sessions ended and their tokens are revoked"
    return said(args, user.as_dict(), text)


def run_user_set_password(args: argparse.Namespace) -> int:
    password = _password(args)
    with account_store(args) as store:
        user = store.update_user(_user(store, args.email).id, password=password)
    return said(
        args,
        user.as_dict(),
        f"password of {user.email} changed: their sessions ended and their tokens are revoked",
    )


def run_token_create(args: argparse.Namespace) -> int:
    with account_store(args) as store:
        user = _user(store, args.email)
        new = store.create_token(user.id, args.name)
    if args.json:
        return said(args, {**new.token.as_dict(), "email": user.email, "secret": new.secret}, "")
    print(
        f"# token {new.token.id} ({new.token.name!r}) for {user.email}; it is shown only this once",
        file=sys.stderr,
    )
    print(new.secret)
    return 0


def run_token_list(args: argparse.Namespace) -> int:
    with account_store(args) as store:
        user = _user(store, args.email)
        tokens = store.list_tokens(user.id)
    if args.json:
        return said(args, [token.as_dict() for token in tokens], "")
    if not tokens:
        print(f"{user.email} has no API tokens")
        return 0
    print(f"{'id':<8}{'state':<9}{'created':<27}{'last used':<27}name")
    for token in tokens:
        created = token.created_at.isoformat(timespec="seconds")
        used = token.last_used_at.isoformat(timespec="seconds") if token.last_used_at else "never"
        state = "revoked" if token.revoked else "active"
        print(f"{token.id:<8}{state:<9}{created:<27}{used:<27}{token.name}")
    return 0


def run_token_revoke(args: argparse.Namespace) -> int:
    with account_store(args) as store:
        token = store.revoke_token(args.id)
    return said(args, token.as_dict(), f"revoked token {token.id} ({token.name!r})")


def _password_options(parser: argparse.ArgumentParser) -> None:
    password = parser.add_mutually_exclusive_group(required=True)
    password.add_argument("--password", help="the password (visible in the process list)")
    password.add_argument(
        "--password-stdin", action="store_true", help="read the password from standard input"
    )


def add_user_commands(sub: argparse._SubParsersAction) -> None:
    """Add the ``user`` command to the ``dramatiq-pg-broker`` parser (an entry point of
    the group ``dramatiq_pg_broker.commands``)."""
    user = sub.add_parser("user", help="admin API users")
    user_sub = user.add_subparsers(dest="user_command", required=True)

    create = user_sub.add_parser("create", help="create a user")
    create.add_argument("--email", required=True)
    create.add_argument("--role", required=True, choices=ROLES)
    _password_options(create)
    create.add_argument(
        "--exists-ok", action="store_true", help="succeed without change if the user exists"
    )
    create.set_defaults(func=run_user_create)

    user_sub.add_parser("list", help="list users").set_defaults(func=run_user_list)

    deactivate = user_sub.add_parser(
        "deactivate", help="deactivate a user: ends their sessions, revokes their tokens"
    )
    deactivate.add_argument("--email", required=True)
    deactivate.set_defaults(func=run_user_active, active=False)

    activate = user_sub.add_parser("activate", help="activate a deactivated user again")
    activate.add_argument("--email", required=True)
    activate.set_defaults(func=run_user_active, active=True)

    set_password = user_sub.add_parser(
        "set-password", help="reset a user's password: ends their sessions, revokes their tokens"
    )
    set_password.add_argument("--email", required=True)
    _password_options(set_password)
    set_password.set_defaults(func=run_user_set_password)
    _json_flags(user_sub)


def add_token_commands(sub: argparse._SubParsersAction) -> None:
    """Add the ``token`` command to the ``dramatiq-pg-broker`` parser (an entry point of
    the group ``dramatiq_pg_broker.commands``)."""
    token = sub.add_parser("token", help="admin API tokens")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    token_create = token_sub.add_parser("create", help="create an API token and print it once")
    token_create.add_argument("--email", required=True, help="the user the token acts as")
    token_create.add_argument("--name", required=True, help="what the token is for")
    token_create.set_defaults(func=run_token_create)

    token_list = token_sub.add_parser("list", help="list a user's tokens (never their values)")
    token_list.add_argument("--email", required=True, help="whose tokens")
    token_list.set_defaults(func=run_token_list)

    token_revoke = token_sub.add_parser("revoke", help="revoke an API token for good")
    token_revoke.add_argument("--id", required=True, type=int, help="the token's id (token list)")
    token_revoke.set_defaults(func=run_token_revoke)
    _json_flags(token_sub)


def _json_flags(group: argparse._SubParsersAction) -> None:
    """``--json`` on each command of ``group``, as on every ``dramatiq-pg-broker``
    command."""
    for parser in group.choices.values():
        parser.add_argument("--json", action="store_true", help="print JSON for scripts")
