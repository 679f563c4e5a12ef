"""Account endpoints of the CLI and AdminClient: API-key identity, audit log, billing usage.

SmolGym has no accounts or billing. `GET /auth/apikey/me` confirms the key is accepted (what
`tinker auth login/status` verifies); `DELETE` cannot revoke a key the server was started with, so it
answers 204 and changes nothing (keys are configured on the command line). The audit log and usage
events are empty; current checkpoint storage is computed from the caller's checkpoints.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from tx.api.context import Ctx, Owner

router = APIRouter(prefix="/api/v1")


@router.get("/auth/apikey/me")
def get_self_api_key(owner: Owner) -> dict[str, Any]:
    return {
        "key_id": int(owner[:12], 16),
        "name": f"smolgym-{owner[:8]}",
        "note": "local SmolGym key",
        "details": {"org_details": {"name": "SmolGym"}, "user_details": {"email": ""}},
    }


@router.delete("/auth/apikey/me", status_code=204)
def delete_self_api_key(_owner: Owner) -> Response:
    return Response(status_code=204)


@router.get("/audit")
def audit_log(_owner: Owner, event_type: str = "all", day: str | None = None) -> dict[str, Any]:
    return {"entries": []}


@router.get("/billing/usage/events")
def billing_usage(_owner: Owner) -> dict[str, Any]:
    return {"data": [], "sessions": {}}


@router.get("/billing/usage/checkpoints/current")
def checkpoint_storage(ctx: Ctx, owner: Owner, project_id: str | None = None) -> dict[str, Any]:
    total, size = ctx.db.records.checkpoint_usage(owner)  # summed by the database: no row read into memory
    item = {"project_id": project_id, "checkpoint_count": total, "size_bytes": size, "size_gigabytes": size / 1e9}
    return {"data": [item]}
