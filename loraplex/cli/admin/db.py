"""``loraplex db``: the gateway's database.

    loraplex db upgrade                 (migrate to the newest schema and exit: a deployment's hook)

The Helm chart's pre-install and pre-upgrade Job runs it before the replicas start.
"""

from __future__ import annotations

import typer

from loraplex.cli.admin.common import operator_group, run_on_database
from loraplex.storage.db import Database, current_revision

db_app = operator_group("The gateway's database.")


@db_app.command("upgrade")
def db_upgrade(ctx: typer.Context) -> None:
    """Migrate the database to the newest schema and exit.

    Deployments run it once before the replicas start (the Helm chart's pre-install and
    pre-upgrade Job). It takes the same lock as the server's start-up migration, so replicas
    that start meanwhile wait for it and then find nothing left to do.
    """

    async def work(db: Database) -> str | None:
        # run_on_database migrates first: what is left is to say where the database now is.
        return await current_revision(db.engine)

    typer.echo(f"database at revision {run_on_database(ctx, work)}")
