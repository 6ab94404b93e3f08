"""A module whose import fails (its body raises), as a user's reward or generate hook with a bug at module level
would: `rollout.reward` / `rollout.custom_generate` naming it must fail in `prepare` with one line."""

raise RuntimeError("broken on purpose at import")
