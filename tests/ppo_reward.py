"""A known reward for the PPO tests: the share of response tokens equal to TARGET_TOKEN."""

TARGET_TOKEN = 7


def target_token_share(prompt_ids: list[int], response_ids: list[int]) -> float:
    if not response_ids:
        return 0.0
    return sum(token == TARGET_TOKEN for token in response_ids) / len(response_ids)
