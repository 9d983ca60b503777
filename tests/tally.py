"""Counted checks for the Python test scripts: a FAIL line for each failed check, then one summary line."""


class Tally:
    def __init__(self, name):
        self.name = name
        self.passed = 0
        self.failed = 0

    def __call__(self, what, ok, detail=""):
        if ok:
            self.passed += 1
        else:
            self.failed += 1
            print(f"FAIL {what}: {detail}")

    def finish(self):
        """Prints `name: N passed, M failed`; returns the process exit code."""
        print(f"{self.name}: {self.passed} passed, {self.failed} failed")
        return 1 if self.failed else 0
