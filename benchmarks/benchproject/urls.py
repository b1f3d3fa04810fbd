from django.urls import path

from benchmarks.benchproject import views

urlpatterns = [
    path("api/v1/payments/", views.guarded(views.PlainPaymentViewSet).as_view({"post": "create"})),
    path("plain/payments/", views.PlainPaymentViewSet.as_view({"post": "create"})),
    path("api/v1/notes/", views.guarded(views.PlainNoteView).as_view()),
    path("plain/notes/", views.PlainNoteView.as_view()),
    path("get/", views.bare_get),
    path("post/", views.bare_post),
    path("floor/redis/", views.floor_redis),
    path("floor/database/", views.floor_database),
    path("floor/notes/", views.FloorNoteView.as_view()),
    path("floor/notes/redis/", views.FloorNoteRedisView.as_view()),
    path("floor/drf/redis/", views.DrfFloorRedis.as_view()),
    path("floor/drf/database/", views.DrfFloorDatabase.as_view()),
]
