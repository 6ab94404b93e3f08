"""Tell someone when a night fails: a Prefect automation that posts to a webhook when a run of the nightly deployment
ends Failed or Crashed.

    python -m flows.alerts --webhook-url https://hooks.slack.com/services/...

Run it once against the Prefect server that holds the deployment (after `prefect deploy`, PREFECT_API_URL set);
running it again replaces both. It saves a `CustomWebhookNotificationBlock` (`vime-nightly-alerts`; the URL is
stored as a secret) posting `{"text": ...}`, the body Slack, Mattermost and Teams incoming webhooks take, and the
automation `vime-nightly-failed`, reacting to the deployment's `prefect.flow-run.Failed` / `Crashed` events. The
message names the flow run, its state message and its page in the Prefect UI. Both are visible and editable in the
UI (Automations, Blocks).
"""

from __future__ import annotations

import argparse
import sys

import flows  # noqa: F401
from vime_core.errors import VimeError

BLOCK = "vime-nightly-alerts"
AUTOMATION = "vime-nightly-failed"
SUBJECT = "vime-flow: {{ flow_run.name }} of {{ deployment.name }} ended {{ flow_run.state.name }}"
BODY = "{{ flow_run.state.message }}\n{{ flow_run|ui_url }}"


class AlertsError(VimeError):
    """The alert cannot be installed as asked; the message says what to fix."""


def install(deployment: str, webhook_url: str, allow_private_urls: bool = False) -> str:
    """Save the webhook block and (re)create the automation for `deployment` (<flow>/<deployment>); returns the
    automation's id."""
    from prefect.automations import Automation, EventTrigger, SendNotification
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.events import ResourceSpecification
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            dep = client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            raise AlertsError(
                f"--deployment {deployment}: no such deployment on {client.api_url}; deploy it first (infra/README.md)"
                " or set PREFECT_API_URL to the server that holds it"
            ) from None
    block = CustomWebhookNotificationBlock(
        name=BLOCK,
        url=webhook_url,
        json_data={"text": "{{subject}}\n{{body}}"},
        allow_private_urls=allow_private_urls,
    )
    block_id = block.save(BLOCK, overwrite=True)
    try:
        Automation.read(name=AUTOMATION).delete()
    except ValueError:  # none yet
        pass
    automation = Automation(
        name=AUTOMATION,
        description=f"Post to the {BLOCK} webhook when a run of {deployment} fails or crashes (flows/alerts.py).",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
            match_related=ResourceSpecification({"prefect.resource.id": f"prefect.deployment.{dep.id}"}),
            posture="Reactive",
            threshold=1,
            within=0,
        ),
        actions=[SendNotification(block_document_id=block_id, subject=SUBJECT, body=BODY)],
    ).create()
    return str(automation.id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.alerts", description=__doc__.splitlines()[0])
    parser.add_argument("--webhook-url", required=True, help="where to POST {'text': ...} for each failed night")
    parser.add_argument("--deployment", default="grpo-pipeline/nightly")
    parser.add_argument(
        "--allow-private-urls", action="store_true", help="the webhook is on a private or loopback address"
    )
    args = parser.parse_args(argv)
    try:
        automation_id = install(args.deployment, args.webhook_url, args.allow_private_urls)
    except AlertsError as e:
        print(f"AlertsError: {e}", file=sys.stderr)
        return 2
    print(f"automation {AUTOMATION} ({automation_id}) posts to {BLOCK} when {args.deployment} fails or crashes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
