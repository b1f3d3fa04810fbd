from rest_framework import serializers

from benchmarks.benchproject.notes.models import Note


class NoteSerializer(serializers.ModelSerializer[Note]):
    class Meta:
        model = Note
        fields = ["id", "title", "body", "done"]
