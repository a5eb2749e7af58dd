"""The turn pipeline every front shares (chat socket, OpenAI API): render the new turn's
tokens (prompt), keep it in the model's window, run it (pipeline), turn tokens into text
(detok, stops), edit and regenerate (edits), find a resent chat's conversation (matching)."""
