from django.contrib import admin
from django.urls import include, path
from rest_framework.routers import DefaultRouter

from django_idempotency.request.decorators import idempotent
from tests.testapp import doors, hostile_views, views

router = DefaultRouter()
router.register("widgets", views.WidgetViewSet)
router.register("credential-widgets", views.CredentialScopedWidgetViewSet, "credential-widget")

urlpatterns = [
    path("admin/", admin.site.urls),
    path("doors/", include(doors)),
    path("api/", include(router.urls)),
    path("api/widget/", views.WidgetAPIView.as_view()),
    path("api/other-widget/", views.WidgetAPIView.as_view()),
    path("api/auth-widget/", views.AuthenticatedWidgetView.as_view()),
    path("api/throttled-widget/", views.ThrottledWidgetView.as_view()),
    path("api/token-widget/", views.TokenWidgetView.as_view()),
    path("api/credential-widget/", views.CredentialScopedWidgetView.as_view()),
    path("api/heartbeat-widget/", views.HeartbeatWidgetView.as_view()),
    path("api/function/", views.api_function_view),
    path("plain/function/", views.plain_function_view),
    path("plain/middleware/", views.plain_undecorated_view),
    path("plain/upload/", idempotent(views.upload_view)),
    path("plain/raw/", idempotent(views.raw_body_view)),
    path("plain/raw-stream/", idempotent(max_body=None)(views.raw_body_view)),
    path("async/widget/", views.async_view),
    path("plain/publish/", views.publish_view),
    path("plain/relay/", views.relay_view),
    path("metrics/", views.metrics_view),
    # tests/reliability: hostile input and security
    path("api/hostile/", hostile_views.HostileAPIView.as_view()),
    path("api/hostile-function/", hostile_views.hostile_api_function_view),
    path("plain/hostile/", hostile_views.hostile_decorated_view),
    path("plain/middleware/hostile/", hostile_views.hostile_middleware_view),
    path("plain/leaky/", hostile_views.leaky_view),
]
