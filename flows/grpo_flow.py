"""On-policy RL (GRPO), end to end: ingest prompts -> tokenize -> rl_round (recursive) -> verify ->
evaluate -> register.

    make sft-3digit                                  # the SFT demo model GRPO starts from
    python flows/grpo_flow.py run                    # the embedded demo (offline, CPU)
    python flows/grpo_flow.py --config-value overrides '{"grpo.rounds": 20}' run
    python flows/grpo_flow.py resume rl_round        # after a failed or killed round task

One controller (`posttrain.rl.controller`) drives the roles: the policy (our trainer), the
rollout engine (the native KV-cache engine in this process, or in a Ray actor:
`grpo.engine: native_actor`; vLLM on a GPU machine: `vllm_actor`), the reward functions named
in the config (`grpo.rewards`), with `grpo.kl_coef > 0` a frozen reference, and with
`grpo.teacher` a teacher whose per-token log-probs of the sampled tokens are a dense reward
(on-policy distillation). `rl_round` is a step that transitions to itself: each task runs
`grpo.rounds_per_task` rounds, stores their rollouts, rewards, advantages and metrics as the
artifact `rounds` (one entry per round: read them round by round from a notebook,
`Flow('GRPOFlow').latest_run['rl_round']`), saves a round checkpoint, and goes on to itself
until `grpo.rounds` are done. A killed or failed round task re-runs from the previous task's
checkpoint (`@retry`, or `resume`), and repeats the trajectory bit for bit. A sweep of
configurations: `flows/grpo_sweep_flow.py`.

Cards: data sources (ingest), prompts kept and dropped (tokenize), a live card per round task
(reward, pass@k, KL, lengths and time split per round), the logit verdict (verify), the
evaluation (one foreach branch per suite; base, tuned and the promoted version: the recipe's
reward on held-out prompts, success rate and pass@k, held-out loss and exact match, an
evidently report), and an overview of the whole run: reward
and pass@k curves over all rounds (end).
"""

from metaflow import card, retry, step

from recipe_configs import ValidateRecipe, recipe_configs
from rl_flow import RLRecipeFlow


@ValidateRecipe
class GRPOFlow(RLRecipeFlow):
    config, overrides = recipe_configs(RLRecipeFlow.RECIPE)

    @card(type="blank", id="tokenize")
    @step
    def tokenize(self):
        """Render every prompt with the chat template's generation prompt (token ids from here on)."""
        self._tokenize_prompts()
        self.next(self.rl_round)

    @retry(times=1, minutes_between_retries=0)
    @card(type="blank", id="rounds", refresh_interval=5)
    @step
    def rl_round(self):
        """`grpo.rounds_per_task` rounds of generate -> score -> advantages -> update -> sync,
        from the previous task's round checkpoint; then again, or on to verify."""
        self._round_task()
        self.next({"again": self.rl_round, "done": self.verify}, condition="route")

    @card(type="blank", id="overview")
    @step
    def end(self):
        """An overview card of the whole run: reward, pass@k, KL and lengths per round."""
        self._overview()


if __name__ == "__main__":
    GRPOFlow()
