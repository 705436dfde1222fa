"""A verifiers (v1) taskset shipped as an example: ask for a word full of one letter.

Written against verifiers' API only, as a third-party environment package would be
(`task.kwargs.env = "meshrl.tasks.vf_letters"`). Its rubric is graded, so the embedded tiny
model, trained from scratch, gets a reward signal from its first step (docs/guides/environments.md).
"""

import verifiers.v1 as vf

LETTERS = "aeo"


class LettersData(vf.TaskData):
    letter: str


class LettersTask(vf.Task[LettersData]):
    @vf.reward(weight=1.0)
    async def letter_share(self, trace: vf.Trace) -> float:
        """The share of the reply's letters that are the asked-for one."""
        letters = [c for c in trace.last_reply.lower() if c.isalpha()]
        return letters.count(self.data.letter) / len(letters) if letters else 0.0

    @vf.reward(weight=0.0)  # logged, not summed in
    async def answered(self, trace: vf.Trace) -> float:
        return float(bool(trace.last_reply))

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class LettersConfig(vf.TasksetConfig):
    system_prompt_text: str | None = None  # e.g. "Answer with one word." (task.kwargs.args)


class LettersTaskset(vf.Taskset[LettersTask, LettersConfig]):
    def load(self):
        for letter in LETTERS:
            prompt = f"Say a word with many {letter} letters."
            yield LettersTask(LettersData(prompt=prompt, system_prompt=self.config.system_prompt_text, letter=letter))


__all__ = ["LettersTaskset"]
